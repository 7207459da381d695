"""The micro-batch fitted to memory (``data.batch_size: auto``): a probe before each attempt's first step, and a step
that runs out of memory done again at half the micro-batch. The global batch never changes: each replica's share of
it (``config.batch.per_replica``) is loaded whole, and cut into micro-batches that accumulation adds up.

**The probe** (``probe``), on every rank, before the checkpoint is loaded: real steps of the real model (its
strategy's local module, activation checkpointing, autocast) with the optimizer's step, so that its state is
allocated too, on a batch of the training set's first samples. A micro-batch ``m`` is taken only if a step of
``m x (1 + data.batch_headroom)`` samples fits: room for a longer batch later and for fragmentation. The
candidates are the divisors of the share, searched largest first, then by bisection (memory grows with the
micro-batch). The weights and the optimizer are put back bitwise (a copy on the host), the random streams are
untouched, and the ranks agree on the smallest answer: the one collective.

**A step** that runs out of memory is done again (``trainer.redo``): at half the micro-batch (``Fit.shrink``: the
largest divisor of the share at most half of it). At a micro-batch of one there is nothing left to halve:
``OutOfMemory``, a user error that names the memory used, the memory there is and the keys to change.

**Where the strategy's steps communicate** (fsdp, pipeline: ``Strategy.steps_communicate``) a rank that runs out
cannot stop and agree: the probe tries one micro-batch, on the wrapped model, and a rank that runs out (there or in
a step) raises ``RanOut``; the allocation runs the attempt again (``cluster.policy``), whose probe stays under half
of it (``below``).
"""

from __future__ import annotations

import copy
import logging
import math
import re
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_core.cluster.failures import out_of_memory, when
from ddp_core.config import StrategyName
from ddp_core.config.batch import micro_batch_candidates
from ddp_core.distributed import collectives, rng
from ddp_core.errors import DdpJobError
from ddp_core.strategies import Strategy
from ddp_core.tasks.base import Task
from ddp_core.trainer.steps import map_tensors, to_device

log = logging.getLogger(__name__)
FIX = "more memory (slurm.mem_gb), strategy.activation_checkpointing=true, a smaller data.global_batch_size, or fsdp"
INVARIANT_FIX = "more memory (slurm.mem_gb), or a smaller data.batch_size (other shards, other bits)"


ENFORCE = re.compile(r"^\[enforce fail at [^\]]*\] err == 0\. ")  # the CPU allocator's message starts so
ERRNO = re.compile(r"\. Error code \d+ \([^)]*\)$")  # and ends so: its errno's words, said once already


class OutOfMemory(DdpJobError):
    """Not even a micro-batch of one fits: the failure table's memory kind (``failures.out_of_memory``)."""


class RanOut(OutOfMemory):
    """A micro-batch of ``micro_batch`` ran out where the strategy's steps communicate (fsdp): the peers wait in a
    collective, so this attempt ends. The rank's ``rank_failed`` event carries ``micro_batch`` (``failures.record``),
    and the allocation runs the attempt again (``cluster.policy``), whose probe takes half of it (``below``)."""

    def __init__(self, micro_batch: int, message: str) -> None:
        super().__init__(message, "the allocation runs the attempt again at half the micro-batch")
        self.micro_batch = micro_batch


def rows(batch: Any) -> int:
    """The samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    parts = list(batch.values()) if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for part in parts:
        if (n := rows(part)) >= 0:
            return n
    return -1


def cut(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of a batch: every tensor in it sliced on its first dimension, anything else kept."""
    return map_tensors(batch, lambda t: t[start:stop])


def split(batch: Any, micro: int) -> list[Any]:
    """A replica's share of a step cut into micro-batches of ``micro`` samples, in order."""
    n = rows(batch)
    return [cut(batch, i, i + micro) for i in range(0, n, micro)]


def repeat(batch: Any, n: int) -> Any:
    """A batch of ``n`` samples: the batch's own, repeated as often as needed."""
    have = rows(batch)
    if have >= n:
        return cut(batch, 0, n)
    times = -(-n // have)
    return map_tensors(batch, lambda t: torch.cat([t] * times)[:n])


def search(candidates: list[int], fits: Callable[[int], bool]) -> tuple[Optional[int], list[tuple[int, bool]]]:
    """The largest of ``candidates`` (ascending) that ``fits``, assuming that what fits is a prefix: the largest
    first (most runs fit whole), then bisection. Returns it (None: not even the smallest) and what was tried."""
    tried: list[tuple[int, bool]] = []

    def attempt(i: int) -> bool:
        ok = fits(candidates[i])
        tried.append((candidates[i], ok))
        return ok

    if attempt(len(candidates) - 1):
        return candidates[-1], tried
    lo, hi, best = 0, len(candidates) - 2, None
    while lo <= hi:
        mid = (lo + hi + 1) // 2
        if attempt(mid):
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    return best, tried


def first_samples(dataset: Dataset, n: int, collate: Optional[Callable[[list[Any]], Any]]) -> Any:
    """The training set's first ``n`` samples as one batch (fewer if it has fewer): what the probe runs on."""
    # Its own generator: an iterator otherwise draws its base seed from the training's random stream.
    loader = DataLoader(dataset, batch_size=n, shuffle=False, collate_fn=collate, generator=torch.Generator())
    return next(iter(loader))


def ranks_out(ran_out: bool) -> list[int]:
    """Collective: the ranks that ran out of memory (every rank says, in one all-reduce)."""
    if collectives.alone():
        return [0] if ran_out else []
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    flags = torch.zeros(world)
    flags[rank] = float(ran_out)
    return [r for r, flag in enumerate(collectives.all_reduce_sum(flags).tolist()) if flag]


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _status_kib(key: str) -> Optional[int]:
    text = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    found = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(found[1]) if found else None


def _cgroup_limit() -> Optional[int]:
    """This process's cgroup memory limit in bytes (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), if any."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidate = Path(f"/sys/fs/cgroup{path}/memory.max")
        elif "memory" in controllers.split(","):
            candidate = Path(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        else:
            continue
        try:
            value = candidate.read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:
            return int(value)
    return None


def host_peak() -> str:
    """This process's peak host memory, as the final log line says it: resident (what a cgroup's limit counts) and
    address space (what ``ulimit -v`` counts)."""
    resident, space = _status_kib("VmHWM"), _status_kib("VmPeak")
    return f"resident {(resident or 0) // 1024} MiB, address space {(space or 0) // 1024} MiB"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_report(device: torch.device) -> str:
    """What this rank used at its peak and what it has: the device's for a GPU; the host's address space against
    ``ulimit -v``, or resident memory against the cgroup's limit (Slurm's) or the node's."""
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        return f"{device}: peak {gib(torch.cuda.max_memory_reserved(device))} reserved of {gib(total)}"
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        return f"host: address space at peak {gib((_status_kib('VmPeak') or 0) * 1024)} of ulimit -v {gib(soft)}"
    peak = gib((_status_kib("VmHWM") or 0) * 1024)
    if (limit := _cgroup_limit()) is not None:
        return f"host: resident at peak {peak} of the job's memory limit {gib(limit)}"
    node = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return f"host: resident at peak {peak} of the node's {gib(int(node[1]) * 1024) if node else '?'}"


def out_of_memory_error(
    step: Optional[int],
    micro: int,
    device: torch.device,
    what: str,
    unit: str = "a micro-batch",
    how: str = "",
    fix: str = FIX,
) -> OutOfMemory:
    """Not even a micro-batch of ``micro`` (one, or the probe's smallest; under train.invariant a shard, ``how``
    it ran) fits: one line, the memory used and the memory there is (``memory_report``), and the keys to change."""
    said = f": {what}" if what else ""
    return OutOfMemory(f"{unit} of {micro} does not fit {when(step)}{how} ({memory_report(device)}){said}", fix)


def no_fit(step: Optional[int], micro: int, device: torch.device, what: str, strategy: Strategy) -> OutOfMemory:
    """The smallest micro-batch does not fit: ``out_of_memory_error``, said ``even recomputing its activations``
    (and without that fix) where they are (``Strategy.recomputes``), and without fsdp's under fsdp."""
    keys = ["more memory (slurm.mem_gb)", "strategy.activation_checkpointing=true", "a smaller data.global_batch_size"]
    keys = [k for k in keys if not (strategy.recomputes() and "checkpointing" in k)]
    keys += [] if strategy.cfg.name is StrategyName.fsdp or strategy.invariant else ["fsdp"]
    how = " even recomputing its activations" if strategy.recomputes() else ""
    return out_of_memory_error(step, micro, device, what, how=how, fix=", ".join(keys[:-1]) + ", or " + keys[-1])


def allocator_words(err: BaseException) -> str:
    """An allocator's failure in its first line, without the CPU allocator's ``[enforce fail ...]`` prefix."""
    return ERRNO.sub("", ENFORCE.sub("", (str(err).strip().splitlines() or [type(err).__name__])[0]))


def ran_out(err: BaseException, step: Optional[int], device: torch.device, invariant: bool = False) -> OutOfMemory:
    """An allocator's failure this attempt did not survive (a fixed micro-batch, an evaluation, a checkpoint's full
    state dict): the same, said with the memory used and there, and the keys that fix it (``invariant``: a
    train.invariant run's, whose micro-batch decides its bits)."""
    auto = "data.batch_size=auto fits the micro-batch to memory, the global batch kept; or " + FIX
    hint = f"strategy.activation_checkpointing=true, {INVARIANT_FIX}" if invariant else auto
    return OutOfMemory(f"ran out {when(step)} ({memory_report(device)}): {allocator_words(err)}", hint)


@dataclass
class Fit:
    """The attempt's micro-batch (``data.batch_size=auto``): this replica's share of a step, the micro-batch it is
    cut into now, and how the probe chose it."""

    share: int
    micro: int
    probe_s: float = 0.0
    tried: list[tuple[int, bool]] = field(default_factory=list)
    multiple: int = 1  # what the micro-batch must be a multiple of (``Strategy.micro_multiple``)
    recomputed: bool = False  # not even the smallest fitted until the probe turned activation checkpointing on
    shards: Optional[int] = None  # train.invariant: the global batch's shards of ``micro`` (the tree's leaves)
    kept: bool = False  # train.invariant: the micro-batch of the run's first probe, kept (``trainer.redo.sharded``)

    @property
    def candidates(self) -> list[int]:
        return micro_batch_candidates(self.share, self.multiple)

    @property
    def accumulation(self) -> int:
        return self.share // self.micro

    def fields(self) -> dict[str, Any]:
        """The start event's record: the micro-batch chosen, what the probe tried (micro-batch, fits), its time."""
        recomputed = {"activations_recomputed": True} if self.recomputed else {}
        shards = {"shards": self.shards, "kept": self.kept} if self.shards else {}
        return {"micro_batch": self.micro, "probe_s": round(self.probe_s, 3), "probed": [list(t) for t in self.tried],
                **recomputed, **shards}  # fmt: skip

    def said(self) -> str:
        """The start log line's note of the probe."""
        recomputed = ", activations recomputed" if self.recomputed else ""
        kept = ", train.invariant's shard kept from the run's first probe" if self.kept else ""
        return f" (data.batch_size=auto, probed in {self.probe_s:.2f} s{recomputed}{kept})"

    @property
    def halved(self) -> Optional[int]:
        """Half the micro-batch: the largest candidate at most half of it; None at the smallest."""
        return max(under(self.share, self.multiple, self.micro // 2), default=None)

    def shrink(self, step: int, device: torch.device, what: str) -> int:
        """Half the micro-batch (the largest divisor of the share at most half of it); ``OutOfMemory`` at one."""
        if (half := self.halved) is None:
            raise out_of_memory_error(step, self.micro, device, what)
        self.micro = half
        return self.micro


def probe(
    task: Task,
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    share: int,
    headroom: float,
    amp: ContextManager[Any],
    cap: Optional[int] = None,
    candidates: Optional[list[int]] = None,
) -> Fit:
    """Collective: the attempt's micro-batch (module docstring), at most ``cap`` (``below``), among ``candidates``
    (train.invariant's: ``trainer.redo.sharded``; else the share's divisors). ``batch``: the training
    set's first samples, at least ``share x (1 + headroom)`` (``first_samples``; repeated if the set is smaller).
    Where the strategy's steps communicate (fsdp) it tries one, the largest, on the wrapped model, every rank in
    step: a rank that runs out raises ``RanOut`` (the attempt ends; the next one's cap is half), or at the smallest
    candidate ``OutOfMemory``."""
    started, device, local = time.perf_counter(), strategy.device, strategy.local_model(model)
    weights = {k: v.detach().to("cpu", copy=True) for k, v in local.state_dict().items()}
    saved = copy.deepcopy(optimizer.state_dict())  # before the first step: its hyperparameters, no state yet
    candidates = under(share, strategy.micro_multiple, cap) if candidates is None else candidates
    if not candidates:  # the allocation's earlier attempt ran out at the smallest already: a user error (policy)
        raise no_fit(None, micro_batch_candidates(share, strategy.micro_multiple)[0], device, "", strategy)
    every = candidates
    if strategy.steps_communicate:
        candidates = candidates[-1:]

    def fits(micro: int) -> bool:
        n = math.ceil(micro * (1 + headroom) / strategy.micro_multiple) * strategy.micro_multiple
        sample = to_device(repeat(batch, n), device)
        try:
            with amp:
                if strategy.steps_communicate:  # on the wrapped model, whose forward gathers the parameters
                    strategy.forward_backward(task, model, sample, 1, True)
                else:
                    task.compute(local, sample).loss.backward()
            optimizer.step()  # its state (AdamW's two moments) is allocated here, at the first step
            return True
        except Exception as err:  # only an allocator's failure means "does not fit"
            if not out_of_memory(err):
                raise
            if strategy.steps_communicate:  # the peers wait in a collective: the attempt ends here
                raise give_up(micro, every, None, device, allocator_words(err), strategy) from None
            return False
        finally:
            optimizer.zero_grad(set_to_none=True)
            free(device)

    with rng.rng_untouched():
        best, tried = search(candidates, fits)
        recomputed = best is None and strategy.recompute_activations(local)  # the last resort: the same bits
        if recomputed:
            best, more = search(candidates, fits)
            tried += more
    strategy.probed()
    local.load_state_dict(weights)
    optimizer.load_state_dict(saved)
    optimizer.state.clear()  # load_state_dict keeps state it was not given
    free(device)
    agreed = agree_min(best or 0)
    if not agreed:
        raise no_fit(None, every[0], device, "", strategy)
    return Fit(share, agreed, time.perf_counter() - started, tried, strategy.micro_multiple, recomputed)


def under(share: int, multiple: int, cap: Optional[int]) -> list[int]:
    """The micro-batch candidates of ``share`` (multiples of ``multiple``) at most ``cap`` (None: all), smallest
    first."""
    return [n for n in micro_batch_candidates(share, multiple) if cap is None or n <= cap]


def give_up(
    micro: int, candidates: list[int], step: Optional[int], device: torch.device, what: str, strategy: Strategy
) -> OutOfMemory:
    """A communicating strategy's out-of-memory at ``micro``: ``RanOut`` while a smaller candidate is left (the
    allocation runs the attempt again under it), else ``OutOfMemory``, the run's end."""
    if micro <= candidates[0]:
        return no_fit(step, micro, device, what, strategy)
    said = f" ({memory_report(device)}): {what}" if what else f" ({memory_report(device)})"
    return RanOut(micro, f"a micro-batch of {micro} ran out {when(step)}{said}")


def below(
    events: list[dict[str, Any]], job_id: Optional[str], restart_count: int
) -> tuple[Optional[int], Optional[dict[str, Any]]]:
    """The micro-batch this attempt's probe must stay under, half of the smallest one that ran out in this
    allocation's earlier attempts (``failure`` events of the same job and restart count with ``micro_batch``: the
    same nodes, so the same memory; a requeue elsewhere probes afresh), and that failure if it is what ended the
    attempt before this one (the shrink to record); else (None, None)."""
    mine = [e for e in events if e["event"] == "failure" and e.get("job_id") == job_id]
    mine = [e for e in mine if e.get("restart_count") == restart_count]
    ran_out = [e for e in mine if e.get("micro_batch")]
    if not ran_out:
        return None, None
    return min(int(e["micro_batch"]) for e in ran_out) // 2, mine[-1] if mine[-1] is ran_out[-1] else None


def agree_min(value: int) -> int:
    """Collective: the smallest ``value`` of all ranks."""
    if collectives.alone():
        return value
    found = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MIN)
    return int(found.item())
