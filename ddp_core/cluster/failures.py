"""What an attempt's failure was, and whether another attempt is worth it: the table, the diagnosis, the budgets and
the nodes to exclude, which the after-failure policy (``cluster.policy``) acts on. Torch-free: read by the batch
script's watcher (``cluster.supervise``) as well as by the ranks.

**The failure table.** A rank that raises records a ``rank_failed`` event (its rank, host, step, error and kind);
a rank that dies by a signal records nothing, and srun's own line (``srun: error: n2: task 1: Killed``) names it.

- **infrastructure**, requeued: a rank killed by a signal (SIGKILL: a user's or Slurm's kill, an OOM killer whose
  log cannot be read; SIGSEGV, SIGBUS, SIGABRT from a library); a broken collective (a peer gone, a connection
  reset or closed, a NCCL or gloo error or timeout); a CUDA device error (ECC, a device lost or unavailable); an I/O
  error of the node (EIO, a stale file handle).
- **user**, fails at once: an exception from the task's or the script's own code (ValueError, KeyError, ...), a
  non-finite loss, a bad config or import.
- **storage**, requeued, no node excluded: the run directory's filesystem is full or failing (ENOSPC, EDQUOT; or
  ``StorageFailing``: ``run.diskfull.MAX_FAILED_SAVES`` checkpoints in a row refused, the trainer training on
  through the ones before), the filesystem's fault, not the node's and not the user's.
- **health**, the node excluded and the job requeued: a failed health check (``cluster.health``), within
  ``slurm.max_health_failures``.
- **memory**, fails at once, no node excluded: a task the step's memory limit killed (srun's ``task 0: Out Of
  Memory``, the cgroup's OOM handler: ``slurm.mem_gb``, or the cluster's default memory per CPU), or an allocator
  that ran out in a rank (``torch.OutOfMemoryError``: the device's; the CPU allocator's ``can't allocate memory``,
  ``MemoryError``, ``ENOMEM``: the host's) that ``data.batch_size=auto`` could not survive (``trainer.memory``). The
  same request runs out again on any node: the job ends FAILED naming the peak and the limit, host or device, and
  the keys that fix it; ``ddpjob resume RUN KEY=...`` continues it. One exception: under ``data.batch_size=auto``
  a strategy whose steps communicate (fsdp) cannot survive it inside the step, so its rank's event carries the
  micro-batch that ran out, and the allocation runs the attempt again at half of it (``cluster.policy``). Where
  nothing of Slurm's limits memory, the kernel's OOM killer SIGKILLs a task: its kill, in the kernel's log of the
  watcher's node where this user may read it (``oom_log``), makes the signal's kill a memory one too.
- **unknown**, requeued once: anything else (an unrecognised RuntimeError, an attempt that ended with no record);
  the same failure at the same step again is a user error.

Infrastructure, storage and unknown failures requeue the same job within ``slurm.max_failures`` (``cluster.policy``,
through ``exits.requeue_within``); a user error ends the job FAILED, and ``ddpjob resume`` continues it from its newest
checkpoint after the fix.

**Which node is bad** is decided on evidence about the node (``to_exclude``): a failed health check, a device error,
or Slurm's own word (DOWN, FAIL, drained). A process killed twice on one node is no such evidence (the OOM killer, a
user's ``kill``, a library's segfault): the run goes on there within its budgets.
"""

from __future__ import annotations

import enum
import errno
import re
import socket
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ddp_core.cluster import node_state
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.oom_log import Question
from ddp_core.config import SlurmConfig
from ddp_core.run.rundir import RunDir

# Events by which the ranks ended the attempt themselves: the watcher leaves such an end alone.
DECIDED = frozenset({"requeued", "requeue_failed", "budget_exhausted", "preempted", "interrupted", "hang", "completed"})


class Kind(str, enum.Enum):
    infrastructure = "infrastructure"
    storage = "storage"  # the run directory's filesystem is full or failing (``run.diskfull``): no node excluded
    health = "health"  # a failed health check (``cluster.health``): the node is excluded
    memory = "memory"  # a memory limit killed a task, or an allocator ran out: the same next time, not retried
    user = "user"
    unknown = "unknown"


# Exceptions raised by the user's own Python code, or by ddpjob for the user's input (DdpJobError: a config, a
# non-finite loss): the same next time, so a retry only wastes the allocation.
_USER_TYPES = frozenset(
    {
        "DdpJobError",
        "ValueError",
        "TypeError",
        "KeyError",
        "IndexError",
        "LookupError",
        "AttributeError",
        "NameError",
        "ImportError",
        "SyntaxError",
        "AssertionError",
        "ArithmeticError",
        "NotImplementedError",
        "FileNotFoundError",
        "IsADirectoryError",
        "NotADirectoryError",
        "PermissionError",
        "RecursionError",
    }
)
# torch.distributed's own errors and the OS's connection errors: a peer or the network, not this rank's code.
_INFRA_TYPES = frozenset({"DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "ConnectionError"})
_INFRA_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE, errno.ENETDOWN})
# A device's own fault (the node's, whichever process met it): evidence that excludes the node (``to_exclude``).
DEVICE_WORDS = re.compile(
    r"ecc error|uncorrectable|device lost|fallen off the bus|gpu is lost|cuda-capable device|devices unavailable"
    r"|cuda driver|xid",
    re.IGNORECASE,
)
_INFRA_WORDS = re.compile(
    r"connection (?:reset|closed|refused)|broken pipe|by peer|nccl|gloo|socket timeout|timed out .*collective"
    r"|input/output error|stale file handle|" + DEVICE_WORDS.pattern,
    re.IGNORECASE,
)


# An allocator's own words: torch's CPU allocator raises a plain RuntimeError ("[enforce fail at alloc_cpu.cpp]
# DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes"); a device's raises
# torch.OutOfMemoryError ("CUDA out of memory. Tried to allocate ..."). A loader worker SIGKILLed mid-epoch is the
# kernel's OOM killer at work on the host ("DataLoader worker (pid 4242) is killed by signal: Killed.").
_MEMORY_WORDS = re.compile(
    r"CPUAllocator: (?:can't allocate memory|not enough memory)|\bout of memory\b"
    r"|DataLoader worker \(pids?\(?s?\)? [\d, ]+\) is killed by signal: Killed",
    re.I,
)
LIMIT_KILLED = "out of memory (the step's memory limit)"  # srun's report of a task its cgroup's OOM handler killed


def out_of_memory(err: BaseException) -> bool:
    """An allocator ran out: the device's (``torch.OutOfMemoryError``), the host's (the CPU allocator's
    RuntimeError, Python's MemoryError), or ddpjob's own ``OutOfMemory`` (``trainer.memory``: no smaller micro-batch
    fits)."""
    names = {t.__name__ for t in type(err).__mro__}
    if names & {"OutOfMemoryError", "OutOfMemory", "MemoryError"}:
        return True
    if isinstance(err, OSError) and err.errno == errno.ENOMEM:  # a fork or mmap refused: a loader's worker
        return True
    return isinstance(err, RuntimeError) and bool(_MEMORY_WORDS.search(str(err)))


def when(step: Optional[int]) -> str:
    """A failure's step as its lines say it: ``at step 40``, or ``before its first step``."""
    return f"at step {step}" if step is not None else "before its first step"


def memory_side(error: str) -> str:
    """Whose memory a memory failure's text says ran out: ``host`` (RAM: the CPU allocator, a memory limit's kill,
    a loader worker, a full state dict on rank 0) or ``device`` (an accelerator's)."""
    device = re.search(r"\b(?:cuda|gpu|device|xpu|mps)\b|OutOfMemoryError", error, re.I)
    host = re.search(r"CPUAllocator|\bMemoryError|memory limit|\bhost\b|DataLoader worker|Cannot allocate", error)
    return "device" if device and not host else "host"


def classify(err: BaseException) -> Kind:
    """The kind of a failure a rank raised (the table in the module docstring)."""
    names = {t.__name__ for t in type(err).__mro__}
    if "HealthCheckFailed" in names:
        return Kind.health
    if out_of_memory(err):  # before the user's types: ddpjob's OutOfMemory is a DdpJobError, with its fix
        return Kind.memory
    if "StorageFailing" in names or (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)):
        return Kind.storage
    if names & _INFRA_TYPES or (isinstance(err, OSError) and err.errno in _INFRA_ERRNOS):
        return Kind.infrastructure
    if names & _USER_TYPES:
        return Kind.user
    if _INFRA_WORDS.search(str(err)):
        return Kind.infrastructure
    return Kind.unknown


def describe(err: BaseException, limit: int = 400) -> str:
    """``Type: message``, the message's first line, cut to ``limit`` characters (room for a user error's hint after
    an out-of-memory's numbers and the allocator's words)."""
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    line = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def record(run_dir: RunDir, env: DistEnv, err: BaseException, step: Optional[int]) -> None:
    """A failing rank's ``rank_failed`` event. Any rank writes it (an append of one short line), never raising: the
    failure itself is what the rank's log must show."""
    try:
        run_dir.log_event(
            "rank_failed",
            job_id=env.job_id,
            restart_count=env.restart_count,
            launch=env.launch,
            rank=env.rank,
            host=socket.gethostname(),
            step=step,
            kind=classify(err).value,
            error=describe(err),
            # a micro-batch that ran out where the strategy's steps communicate (trainer.memory.RanOut): the
            # allocation runs the attempt again under half of it
            **({"micro_batch": micro} if isinstance(micro := getattr(err, "micro_batch", None), int) else {}),
        )
    except OSError:
        pass


# srun's own report of a task that did not end well: "srun: error: n2: task 1: Killed", "... tasks 0-1: Exited with
# exit code 1", "... task 0: Segmentation fault (core dumped)".
_SRUN_TASK = re.compile(r"^srun: error: (?P<host>\S+): tasks? (?P<tasks>[\d,-]+): (?P<what>.+)$")


# srun's report that it could not start the job step at all, no rank ran: the controller or the nodes were not ready
# (a slurmctld just restarted, its nodes re-registering: "Unable to create step for job 57: Memory required by task is
# not available"), never the ranks' fault. An infrastructure failure; the policy waits before the next step
# (``cluster.policy.restart``).
_SRUN_STEP = re.compile(
    r"^srun: error: (?P<what>Unable to create step for job .+|Unable to contact slurm controller.*"
    r"|Slurm controller not responding.*)$"
)
NOT_STARTED = "srun could not start the job step"


def srun_step_error(lines: list[str]) -> str:
    """srun's own line saying the step could not be created (``_SRUN_STEP``), or ''."""
    return next((m["what"].strip() for line in lines if (m := _SRUN_STEP.match(line.strip()))), "")


@dataclass(frozen=True)
class TaskEnd:
    """One line of srun's report: a task (or several) on a host, and how it ended."""

    host: str
    rank: int  # the first task the line names
    what: str

    @property
    def out_of_memory(self) -> bool:
        """Killed by the step's memory limit (the cgroup's OOM handler), as srun reports it."""
        return self.what.lower() == "out of memory"

    @property
    def by_signal(self) -> bool:
        """Killed by a signal of its own, not an exit code, and not the SIGTERM srun sends the others."""
        return not self.what.startswith("Exited with exit code") and self.what != "Terminated"


def srun_task_ends(lines: list[str]) -> list[TaskEnd]:
    ends = []
    for line in lines:
        if m := _SRUN_TASK.match(line.strip()):
            first = re.split(r"[,-]", m["tasks"])[0]
            ends.append(TaskEnd(m["host"].rstrip(":"), int(first), m["what"].strip()))
    return ends


@dataclass(frozen=True)
class Failure:
    """What ended an attempt: the ``failure`` event the watcher records."""

    kind: Kind
    rank: Optional[int]
    host: Optional[str]
    step: Optional[int]
    error: str
    lost: str = ""  # Slurm's word that ``host`` was lost (NODE_FAIL, gone from the allocation): evidence it is bad
    micro_batch: Optional[int] = None  # memory: the micro-batch that ran out, which the next attempt halves

    @property
    def where(self) -> str:
        return f"rank {self.rank} on {self.host}" if self.rank is not None else "the job step"

    @classmethod
    def of_rank(cls, kind: Kind, event: dict[str, Any]) -> Failure:
        """The failure a rank's ``rank_failed`` event tells."""
        micro = event.get("micro_batch") if kind is Kind.memory else None
        return cls(kind, event.get("rank"), event.get("host"), event.get("step"), str(event.get("error")), "", micro)

    def fields(self) -> dict[str, Any]:
        shrink = {"micro_batch": self.micro_batch} if self.micro_batch else {}
        return {"kind": self.kind.value, "rank": self.rank, "host": self.host, "step": self.step, "error": self.error,
                **shrink}  # fmt: skip

    def same_as(self, event: dict[str, Any]) -> bool:
        """The same failure as an earlier attempt's ``failure`` event: same error, same step."""
        return event.get("error") == self.error and event.get("step") == self.step


def diagnose(
    rank_failures: list[dict[str, Any]],
    ends: list[TaskEnd],
    status: int,
    last_step: Optional[int],
    step_error: str = "",
    kernel: Optional[Question] = None,
) -> Failure:
    """The attempt's failure from its ranks' ``rank_failed`` events and srun's report (``ends``, and ``step_error``:
    ``srun_step_error``'s line). A failed health check comes first (the others' errors follow from its rank leaving),
    then a user error any rank raised; else a task killed by a signal (likewise: srun's report, or a torchrun agent's
    ``rank_failed`` with the ``signal``), out of memory where ``kernel`` (``oom_log.reader``) finds the OOM
    killer's kill of a SIGKILLed one; else a step srun could not start; else the first rank's error."""
    by_time = sorted(rank_failures, key=lambda e: e.get("t", 0))
    steps = [e["step"] for e in by_time if isinstance(e.get("step"), int)]
    step = max(steps) if steps else last_step
    for kind in (Kind.health, Kind.user, Kind.memory):
        if found := [e for e in by_time if e.get("kind") == kind.value]:
            return Failure.of_rank(kind, found[0])
    if oom := [e for e in ends if e.out_of_memory]:  # the others' errors (a peer gone) follow from it
        return Failure(Kind.memory, oom[0].rank, oom[0].host, step, LIMIT_KILLED)
    killed, by_signal = [e for e in ends if e.by_signal], [e for e in by_time if e.get("signal")]  # srun's, an agent's
    tasks = killed or [TaskEnd(str(e.get("host")), e.get("rank") or 0, e["signal"]) for e in by_signal]
    asked = kernel or (lambda host, rank: None)  # the kernel's OOM killer's kill of it, in this node's log
    for task in [t for t in tasks if t.what in ("Killed", "SIGKILL")]:
        if (kill := asked(task.host, task.rank)) is not None:
            return Failure(Kind.memory, task.rank, task.host, step, kill.said())
    if killed:
        end = killed[0]
        return Failure(Kind.infrastructure, end.rank, end.host, step, f"killed by a signal ({end.what})")
    if by_signal:
        return Failure.of_rank(Kind.infrastructure, by_signal[0])
    if step_error:  # no rank ran: Slurm was not ready for the step
        return Failure(Kind.infrastructure, None, None, step, f"{NOT_STARTED}: {step_error}")
    if by_time:
        return Failure.of_rank(Kind(by_time[0].get("kind", Kind.unknown.value)), by_time[0])
    if ends:
        end = ends[0]
        return Failure(Kind.unknown, end.rank, end.host, step, f"task ended: {end.what}")
    return Failure(Kind.unknown, None, None, step, f"the job step ended with status {status} and no rank said why")


def as_repeated(failure: Failure, earlier: list[dict[str, Any]]) -> Failure:
    """An unknown failure seen before at the same step (``earlier``: the run's ``failure`` events) is a user error."""
    if failure.kind is Kind.unknown and any(failure.same_as(e) for e in earlier):
        return Failure(Kind.user, failure.rank, failure.host, failure.step, failure.error + " (again, same step)")
    return failure


def budget(failure: Failure, slurm: SlurmConfig) -> tuple[str, int]:
    """The requeue budget ``failure`` spends and its limit: a failed health check has one of its own."""
    if failure.kind is Kind.health:
        return "health_failure", slurm.max_health_failures
    return "failure", slurm.max_failures


def spent(failure: Failure, earlier: list[dict[str, Any]], restarted: Sequence[dict[str, Any]] = ()) -> int:
    """How much of its requeue budget ``failure`` spends, with ``earlier`` (the run's ``failure`` events before it) on
    the same budget: user errors never count, nor the failures a restart inside the allocation took (``restarted``:
    the job's ``restarted`` events, each with its failure's kind)."""
    health = failure.kind is Kind.health

    def same(e: dict[str, Any]) -> bool:
        return e.get("kind") not in (Kind.user.value, Kind.memory.value) and (e.get("kind") == "health") == health

    return 1 + sum(1 for e in earlier if same(e)) - sum(1 for e in restarted if same(e))


def last_kind(events: list[dict[str, Any]]) -> Optional[str]:
    """The kind of the run's last ``failure`` event (None without one)."""
    return next((str(e.get("kind")) for e in reversed(events) if e["event"] == "failure"), None)


def excluded_hosts(events: list[dict[str, Any]]) -> dict[str, str]:
    """The hosts a run's later attempts stay off, with why: its ``excluded`` events, less the hosts an ``included``
    event took back (``ddpjob resume --include-node``)."""
    hosts: dict[str, str] = {}
    for e in events:
        if e["event"] == "excluded" and e.get("host"):
            hosts[str(e["host"])] = str(e.get("reason", ""))
        elif e["event"] == "included":
            hosts.pop(str(e.get("host")), None)
    return hosts


def to_exclude(events: list[dict[str, Any]], failure: Failure, node: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The host to exclude after ``failure``, on evidence about the node, never on how often its processes failed (a
    rank killed twice, by the OOM killer or by hand, says nothing about the node): a failed health check, a device
    error (``DEVICE_WORDS``), the node lost with the attempt's step (``Failure.lost``: Slurm ended the attempt for it,
    or took it out of the allocation), or, for any other infrastructure failure, Slurm's own word (``node``: its
    ``scontrol show node`` fields; ``node_state.bad``: DOWN, FAIL, drained). A host already excluded is not named
    again."""
    host = failure.host
    if host is None or host in excluded_hosts(events):
        return {}
    if failure.kind is Kind.health:
        return {host: f"failed a health check: {failure.error}"}
    if failure.kind is not Kind.infrastructure:
        return {}
    if failure.lost:
        return {host: f"lost: {failure.lost}"}
    if DEVICE_WORDS.search(failure.error):
        return {host: f"a device error: {failure.error}"}
    if said := node_state.bad(node):
        return {host: f"Slurm says {said}, after: {failure.error}"}
    return {}


def attempt_events(events: list[dict[str, Any]], env: DistEnv) -> list[dict[str, Any]]:
    """This job step's events (its attempt's, and within it its launch's: ``DistEnv.launch``): from its ``start`` on;
    without one (it failed before its first step), its ranks' ``rank_failed`` events."""
    mine = [e for e in events if e.get("job_id") == env.job_id]

    def this_step(e: dict[str, Any]) -> bool:
        return e.get("restart_count") == env.restart_count and e.get("launch", 0) == env.launch

    starts = [i for i, e in enumerate(mine) if e["event"] == "start" and this_step(e)]
    if starts:
        return mine[starts[-1] :]
    return [e for e in mine if e["event"] == "rank_failed" and this_step(e)]
