"""The node-local checkpoint tier (``checkpoint.local_every_steps``): frequent copies of the train state in node
memory or on a node's own disk, so an attempt that runs again in the same job loses at most a few steps.

Where: ``LOCAL_PATH/ddpjob-USER-JOB/HOST/`` (``checkpoint.local_path``; USER this account, JOB the launcher's job
id, the Slurm job's across its requeues and restarts; HOST this node's name), holding ``run.txt`` (the run directory
that owns it: a folder left by another run under a reused job id is emptied, never loaded) and the copies, each in the
format of ``store`` (data, then its manifest with the checksum, written last; the newest ``KEEP`` kept):

- full-state strategies (ddp, dp, model_parallel: every replica holds the whole state): ``full/``, written by the
  node's first rank. Every node holds its own copy: those are the replicas.
- sharded strategies (fsdp, pipeline): ``wWORLD/rank-R/`` per rank, the rank's own shards (its ``Layout``'s sharded
  state, DTensors as their local tensors), written by that rank. Each rank also sends every copy to the rank of
  the same index on the next node, which keeps it in its own node's ``rank-R`` folder (``local_replica``).

A copy is written like an async full checkpoint (``full.FullWriter``: staged to host memory, written in a background
thread; training blocks only for the copy that the next forward and backward do not hide). Besides the model and
optimizer it holds ``ranks``, the ranks' train-state parts (``TrainState.parts``, packed by each rank in the
training thread and gathered in the writers' threads: ``local_replica.gather_parts``): every rank's in a full-state
copy, rank 0's and the writer's own in a sharded one, so each copy restores its ranks by itself. Finding, agreeing on
and loading a copy at start: ``local_restore``.

The folders are this user's alone (``ddp_core.run.private``: made 0700 and checked with ``lstat``, files 0600): the
path is predictable, and a folder another user made first (or a symlink in its place) is refused, never written to
or restored from. The tier is an optimisation, so what it cannot do never ends the run: a refused folder, or too
little room at the first copy, turns it off for the attempt on every rank (``TierOff``: a warning and a
``local_tier_off`` event); a copy that fails for room or I/O (ENOSPC, EDQUOT, EIO: another job filled ``/dev/shm``)
is skipped with a warning and a ``local_copy_failed`` event, and the next interval's copy is tried again (no rank
waits for another's verdict; a restore takes only a step every rank holds, so a gap costs nothing). The durable
checkpoints go on throughout.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from ddp_core.checkpoint import store
from ddp_core.checkpoint.full import CheckpointWriteError, FullWriter
from ddp_core.checkpoint.local_folder import (
    PATH_HINT,
    REFUSED_HINT,
    TierOff,
    check_folder,
    claim,
    fallback_errno,
    folder_bytes,
    off_for_attempt,
    record,
    refusal,
)
from ddp_core.checkpoint.local_replica import Parts, Ring, ring_peers
from ddp_core.checkpoint.staging import storage_key
from ddp_core.cluster.env import DistEnv
from ddp_core.config import CheckpointConfig
from ddp_core.distributed import collectives
from ddp_core.errors import DdpJobError
from ddp_core.run import private
from ddp_core.run.rundir import RunDir

log = logging.getLogger(__name__)

KEEP = 2  # complete copies kept per folder (a third exists while the next one is written)
FULL_FOLDER = "full"


def sharded_folder(world_size: int, rank: int) -> str:
    """A sharded copy's folder in a node's, relative: rank R's shards at world size W."""
    return f"w{world_size}/rank-{rank}"


def tensor_bytes(tree: Any) -> int:
    """The bytes of a state's tensors, each storage once (what a copy of it takes, within its pickle's overhead)."""
    seen: dict[Any, int] = {}
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.layout == torch.strided:
                seen[storage_key(item)] = item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(seen.values())


def local_shards(tree: Any) -> Any:
    """A sharded state (``Layout.sharded_state``) with each DTensor replaced by this rank's shard of it, a plain
    tensor: what this rank's copy holds (it restores at the same world size only, into the same layout)."""
    if isinstance(tree, dict):
        return {key: local_shards(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [local_shards(value) for value in tree]
    to_local = getattr(tree, "to_local", None)
    return to_local() if isinstance(tree, torch.Tensor) and callable(to_local) else tree


@torch.no_grad()
def fill_shards(template: Any, saved: Any) -> Any:
    """``template`` (this attempt's ``Layout.sharded_state``, of the same layout) with ``saved``'s values: tensors
    copied into its tensors (a DTensor's local shard), in place, on their devices; everything else taken as saved."""
    if isinstance(saved, dict) and isinstance(template, dict):
        return {key: fill_shards(template[key], value) if key in template else value for key, value in saved.items()}
    if isinstance(saved, list) and isinstance(template, list) and len(saved) == len(template):
        return [fill_shards(t, value) for t, value in zip(template, saved, strict=True)]
    if isinstance(saved, torch.Tensor) and isinstance(template, torch.Tensor):
        to_local = getattr(template, "to_local", None)
        target = to_local() if callable(to_local) else template
        if target.shape == saved.shape:
            target.copy_(saved)
            return template
    return saved


def open_tier(cfg: CheckpointConfig, env: DistEnv, run_dir: RunDir, kind: str, optimizer: Any) -> Optional[LocalTier]:
    """Collective: this attempt's node-local tier, or None where it cannot be used (``TierOff``: logged as a warning
    on every rank, a ``local_tier_off`` event from rank 0): the run goes on with its durable checkpoints."""
    try:
        return LocalTier(cfg, env, run_dir, kind, optimizer)
    except TierOff as off:
        off_for_attempt(off, env, run_dir)
        return None


class LocalTier:
    """One attempt's node-local copies, on every rank. The constructor and ``save`` are collective; it is built only
    when ``checkpoint.local_every_steps`` is set and the process has a job id. The constructor raises ``TierOff`` on
    every rank when a node's folder is refused (``open_tier``)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        env: DistEnv,
        run_dir: RunDir,
        kind: str,
        optimizer: Any,
        host: Optional[str] = None,
    ) -> None:
        assert env.job_id is not None and cfg.local_every_steps > 0, "built for a job with the tier on"
        self.every, self.env, self.kind, self.run_dir = cfg.local_every_steps, env, kind, run_dir
        self.host = host or socket.gethostname()
        self.path = Path(cfg.local_path)
        check_folder(self.path, self.host)
        self.root = self.path / private.per_user_name(env.job_id)
        self.node = self.root / self.host
        self.hosts = [str(h) for h in collectives.gather_to_all(self.host)]
        self.node_ranks = [r for r, h in enumerate(self.hosts) if h == self.host]
        self.leader = self.node_ranks[0] == env.rank  # the node's first rank
        refused: Optional[tuple[str, str]] = None
        if self.leader:
            try:
                claim(self.root, self.node, run_dir.path, self.host)
            except DdpJobError as err:
                refused = (err.message, err.hint)
            except OSError as err:  # a full local_path (ENOSPC for the owner file): no room for copies either
                refused = (f"on {self.host}, the node-local tier's folder {self.node}: {err}", REFUSED_HINT)
        # Every node's folder claimed before any rank reads or writes in it, and one verdict on every rank.
        verdict = next((v for v in collectives.gather_to_all(refused) if v is not None), None)
        if verdict is not None:
            raise TierOff(*verdict)
        # Restores and replicas travel over a gloo group of their own: the replicas from the writer's thread, beside
        # training's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() and env.world_size > 1 else None
        self.parts = Parts(self.group, env.rank, env.world_size)
        full = kind == store.FULL
        self.folder = self.node / (FULL_FOLDER if full else sharded_folder(env.world_size, env.rank))
        self.ring: Optional[Ring] = None
        if not full:
            following, previous = ring_peers(self.hosts, env.rank)
            if following is not None or previous is not None:
                self.ring = Ring(self.node / f"w{env.world_size}", env.rank, following, previous, self.group, KEEP)
        self.writer: Optional[FullWriter] = None
        self.side: Optional[ThreadPoolExecutor] = None  # a full-state strategy's other ranks: their parts go out
        self.sending: Optional[Future[Any]] = None
        if self.leader or not full:
            after = self.ring.exchange if self.ring is not None else None
            # The optimizer's tensors are copied beside the next forward and backward (plain tensors only: a
            # sharded state's local shards are copied before save returns).
            self.writer = FullWriter(
                self.folder,
                KEEP,
                True,
                env.rank,
                optimizer if full else None,
                self._gathered,
                after,
                logging.DEBUG,
                private=True,
            )
        else:
            self.side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-local")
        self.checked = False  # the room in local_path, measured at this attempt's first copy
        self.off: Optional[str] = None  # why the tier was turned off in this attempt (no room at its first copy)
        self.failing = False  # the last copy failed (ENOSPC, ...): warned once until one succeeds again
        self.in_flight = False  # a copy was handed to the writer and its outcome not yet collected

    def due(self, step: int, max_steps: int) -> bool:
        return self.off is None and step % self.every == 0 and step < max_steps

    def refusal(self) -> Optional[DdpJobError]:
        """Why this node's folders are not this user's alone (checked before every restore), or None."""
        return refusal(self.root, self.host) or refusal(self.node, self.host)

    def save(self, step: int, state: dict[str, Any], own: bytes) -> None:
        """Collective: the copy of ``step`` in the background: ``state`` this rank's model and optimizer (its shards),
        ``own`` its packed train-state part (``TrainState.parts``); the copy holds them as ``{"ranks": {RANK: part}}``
        beside ``state``. A full-state strategy's ranks other than the node's first send their part only."""
        if not self.checked:
            self.checked = True
            parts = len(own) * (self.env.world_size if self.kind == store.FULL else 2)
            self._agree_on_room(tensor_bytes(state) + parts)
        if self.off is not None:
            return
        if self.writer is None:
            assert self.side is not None
            self._sent()  # one in flight: the parts go out in step order
            self.sending = self.side.submit(self._gathered, step, {"ranks": own})
            return
        self.collect()
        self.writer.save(step, state | {"ranks": own})
        self.in_flight = True

    def _agree_on_room(self, size: int) -> None:
        """Collective, at the first copy: every writer checks its room (``check_room``); if one lacks it, the tier is
        off on every rank for the rest of the attempt."""
        short: Optional[tuple[str, str]] = None
        if self.writer is not None:
            try:
                self.check_room(size)
            except DdpJobError as err:
                short = (err.message, err.hint)
        verdict = next((v for v in collectives.gather_to_all(short) if v is not None), None)
        if verdict is not None:
            self.off = verdict[0]
            off_for_attempt(DdpJobError(*verdict), self.env, self.run_dir)
            self.close()

    def collect(self, writer: Optional[FullWriter] = None) -> None:
        """Wait for the outcome of this rank's copy in flight, if it writes any: a failure for room or I/O
        (``FALLBACK_ERRNOS``) is a warning and a ``local_copy_failed`` event from this rank (once until a copy
        succeeds again), and the next copy is tried; any other is raised."""
        writer = writer or self.writer
        if writer is None:
            return
        try:
            writer.wait()
        except CheckpointWriteError as err:
            code = fallback_errno(err)
            if code is None:
                raise
            if not self.failing:
                log.warning(
                    "node-local copies on %s failed (%s): skipped, the run goes on with its durable checkpoints; "
                    "the next copy is tried in %d steps: %s",
                    self.host,
                    errno.errorcode.get(code, code),
                    self.every,
                    err.message,
                )
                record(
                    self.run_dir,
                    "local_copy_failed",
                    job_id=self.env.job_id,
                    rank=self.env.rank,
                    host=self.host,
                    error=err.message,
                )
            self.failing = True
        else:
            if self.failing and self.in_flight:
                log.warning("node-local copies on %s written again", self.host)
                self.failing = False
        self.in_flight = False

    def _gathered(self, step: int, snapshot: dict[str, Any]) -> dict[str, Any]:
        """In the background (the writer's ``before_write``): the ranks' parts in place of this rank's own."""
        return snapshot | {"ranks": self.parts.gather(snapshot["ranks"], every=self.kind == store.FULL)}

    def _sent(self) -> None:
        sending, self.sending = self.sending, None
        if sending is not None:
            sending.result()

    def check_room(self, size: int) -> None:
        """Raise ``DdpJobError`` naming checkpoint.local_path when this node's writers' copies will not fit: each
        keeps ``KEEP`` and writes one more, twice that with a peer node's replicas."""
        writers = 1 if self.kind == store.FULL else len(self.node_ranks)
        need = (KEEP + 1) * (size + (1 << 20)) * writers * (2 if self.ring is not None else 1)
        stat = os.statvfs(self.path)
        room = stat.f_bavail * stat.f_frsize + folder_bytes(self.node)  # this node's older copies are replaced
        if need > room:
            raise DdpJobError(
                f"checkpoint.local_path {self.path} on {self.host} has {room / 1e6:.0f} MB for the node-local tier, "
                f"which needs {need / 1e6:.0f} MB there ({KEEP} copies kept and one being written, "
                f"{size / 1e6:.1f} MB of state per rank{', with the peer node replicas' if self.ring else ''})",
                f"set checkpoint.local_path to a node-local folder with room (where it is /dev/shm, that is the "
                f"node's memory: ask for more with slurm.mem_gb), {PATH_HINT}",
            )
        log.info("node-local copies: %s (%.0f MB free, %.1f MB per copy)", self.folder, room / 1e6, size / 1e6)

    def close(self, wait: bool = True) -> None:
        """Complete the copy in flight. Without ``wait`` (a failed attempt) it is left to the process's exit: it
        meets the other ranks (their parts, a peer node), and waiting for a rank that is gone would never return."""
        writer, side, self.writer, self.side = self.writer, self.side, None, None
        if not wait:
            return
        if writer is not None:
            self.collect(writer)
            writer.close()
        if side is not None:
            try:
                self._sent()
            finally:
                side.shutdown()

    def discard(self) -> None:
        """Remove this node's copies (the run completed, or failed in a way another attempt cannot fix)."""
        shutil.rmtree(self.node, ignore_errors=True)
        try:
            self.root.rmdir()  # the job's folder, once no node's is left in it (a shared local_path)
        except OSError:
            pass
        log.info("removed the node-local copies in %s", self.node)
