"""The node-local checkpoint tier (``checkpoint.local_every_steps``): frequent copies of the train state in node
memory or on a node's own disk, so an attempt that runs again in the same job loses at most a few steps.

Where: ``LOCAL_PATH/ddpjob-JOB/HOST/`` (``checkpoint.local_path``; JOB is the launcher's job id, the Slurm job's
across its requeues and restarts; HOST this node's name), holding ``run.txt`` (the run directory that owns it: a
folder left by another run under a reused job id is removed, never loaded) and the copies, each in the format of
``store`` (data, then its manifest with the checksum, written last; the newest ``KEEP`` kept):

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
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from ddp_core.checkpoint import store
from ddp_core.checkpoint.full import FullWriter
from ddp_core.checkpoint.local_replica import Parts, Ring, ring_peers
from ddp_core.checkpoint.staging import storage_key
from ddp_core.cluster.env import DistEnv
from ddp_core.config import CheckpointConfig
from ddp_core.distributed import collectives
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir, atomic_write_text

log = logging.getLogger(__name__)

KEEP = 2  # complete copies kept per folder (a third exists while the next one is written)
OWNER = "run.txt"
FULL_FOLDER = "full"
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_PATH_HINT = "or set checkpoint.local_every_steps=0 to run without the node-local tier"


def sharded_folder(world_size: int, rank: int) -> str:
    """A sharded copy's folder in a node's, relative: rank R's shards at world size W."""
    return f"w{world_size}/rank-{rank}"


def check_folder(path: Path, host: str) -> None:
    """On the node: ``checkpoint.local_path`` exists, is a folder and this process may write there."""
    where = f"checkpoint.local_path {path} on {host}"
    if not path.exists():
        problem, fix = "does not exist", "name a node-local folder every node has (/dev/shm, /tmp)"
    elif not path.is_dir():
        problem, fix = "is not a folder", "name a node-local folder (/dev/shm, /tmp)"
    elif not os.access(path, os.W_OK | os.X_OK):
        problem, fix = "is not writable here", "name a folder the job may write (/dev/shm, /tmp)"
    else:
        return
    raise DdpJobError(f"{where} {problem}", f"{fix}, {_PATH_HINT}")


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


def folder_bytes(folder: Path) -> int:
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:  # pruned meanwhile
                pass
    return total


def claim(node: Path, run_dir: Path) -> None:
    """The node's first rank: ``node`` belongs to this run. A folder another run left under the same job id (a
    reused id, an adaptive sweep's worker on its next trial) or one without its owner file is removed first."""
    owner = node / OWNER
    try:
        ours = owner.read_text().strip() == str(run_dir)
    except OSError:
        ours = False
    if not ours and node.exists():
        log.warning("removing %s: local copies of another run (or of none)", node)
        shutil.rmtree(node, ignore_errors=True)
    node.mkdir(parents=True, exist_ok=True)
    if not ours:
        atomic_write_text(owner, f"{run_dir}\n")


class LocalTier:
    """One attempt's node-local copies, on every rank. The constructor and ``save`` are collective; it is built only
    when ``checkpoint.local_every_steps`` is set and the process has a job id."""

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
        self.every, self.env, self.kind = cfg.local_every_steps, env, kind
        self.host = host or socket.gethostname()
        self.path = Path(cfg.local_path)
        check_folder(self.path, self.host)
        job = env.job_id if _SAFE.fullmatch(env.job_id) else hashlib.sha256(env.job_id.encode()).hexdigest()[:16]
        self.root = self.path / f"ddpjob-{job}"
        self.node = self.root / self.host
        self.hosts = [str(h) for h in collectives.gather_to_all(self.host)]
        self.node_ranks = [r for r, h in enumerate(self.hosts) if h == self.host]
        self.leader = self.node_ranks[0] == env.rank  # the node's first rank
        if self.leader:
            claim(self.node, run_dir.path)
        # Restores and replicas travel over a gloo group of their own: the replicas from the writer's thread, beside
        # training's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() and env.world_size > 1 else None
        collectives.barrier()  # every node's folder claimed before any rank reads or writes in it
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
                self.folder, KEEP, True, env.rank, optimizer if full else None, self._gathered, after, logging.DEBUG
            )
        else:
            self.side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-local")
        self.checked = False  # the room in local_path, measured at this attempt's first copy

    def due(self, step: int, max_steps: int) -> bool:
        return step % self.every == 0 and step < max_steps

    def save(self, step: int, state: dict[str, Any], own: bytes) -> None:
        """Collective: the copy of ``step`` in the background: ``state`` this rank's model and optimizer (its shards),
        ``own`` its packed train-state part (``TrainState.parts``); the copy holds them as ``{"ranks": {RANK: part}}``
        beside ``state``. A full-state strategy's ranks other than the node's first send their part only."""
        if self.writer is None:
            assert self.side is not None
            self._sent()  # one in flight: the parts go out in step order
            self.sending = self.side.submit(self._gathered, step, {"ranks": own})
            return
        if not self.checked:
            self.check_room(tensor_bytes(state) + len(own) * (self.env.world_size if self.kind == store.FULL else 2))
            self.checked = True
        self.writer.save(step, state | {"ranks": own})

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
                f"node's memory: ask for more with slurm.mem_gb), {_PATH_HINT}",
            )
        log.info("node-local copies: %s (%.0f MB free, %.1f MB per copy)", self.folder, room / 1e6, size / 1e6)

    def close(self, wait: bool = True) -> None:
        """Complete the copy in flight. Without ``wait`` (a failed attempt) it is left to the process's exit: it
        meets the other ranks (their parts, a peer node), and waiting for a rank that is gone would never return."""
        writer, side, self.writer, self.side = self.writer, self.side, None, None
        if not wait:
            return
        if writer is not None:
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
