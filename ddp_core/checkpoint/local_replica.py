"""What the node-local tier's writers exchange with the other ranks, in their background threads, over the tier's own
gloo group: the ranks' own train-state parts (``gather_parts``), and the sharded copies' replicas (``Ring``).

**Own parts** (``Parts``). Each rank's RNG state and per-rank components (``TrainState.parts``; rank 0's also the
train state's shared entries), packed in the training thread, reach the writers in the background: every rank's to
every rank under a full-state strategy (each node's copy restores every rank), rank 0's and the writer's own under a
sharded one (a rank's copy restores that rank). Every rank takes part once per copy, in step order: writers in
``FullWriter``'s ``before_write``, the other ranks of a full-state strategy in a thread of their own
(``local.LocalTier``).

**Replicas** of the sharded copies on a peer node: node k's shards are kept on node (k+1) % nodes.

The nodes are ordered by their first rank; the rank of index i on node k sends each copy it wrote to the rank of index
i on node k+1 and receives the copy of the rank of index i on node k-1 (with 2 nodes, the same peer both ways).
``Ring.exchange`` runs in the writer's thread once the copy is written (``full.FullWriter``'s ``after_write``), over
the tier's own gloo group: every rank writes its copies at the same steps, so each rank's exchanges pair up with
its peers' in order. A failed write still takes part (sending nothing), so its peer is not left waiting.

What a rank receives goes into its own node's folder under the sender's rank (``wWORLD/rank-R/``), in the format of
``store``: the data, then the manifest the sender wrote (its checksum covers the data: ``store.verify`` checks the
replica as it checks any copy).
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from ddp_core.checkpoint import loadable, store
from ddp_core.run import private
from ddp_core.run.rundir import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)


def ring_peers(hosts: list[str], rank: int) -> tuple[Optional[int], Optional[int]]:
    """(the rank this one sends its copies to, the rank it receives copies from), from every rank's host: the
    ranks of the same index on the next and the previous node; None where that node has fewer ranks, or on a job
    of one node (nothing to replicate to)."""
    nodes: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        nodes.setdefault(host, []).append(r)
    order = list(nodes)
    if len(order) < 2:
        return None, None
    k = order.index(hosts[rank])
    index = nodes[hosts[rank]].index(rank)
    following, previous = nodes[order[(k + 1) % len(order)]], nodes[order[k - 1]]
    return (
        following[index] if index < len(following) else None,
        previous[index] if index < len(previous) else None,
    )


def wait_all(works: list[Any]) -> None:
    """Wait for point-to-point operations (``dist.isend``/``irecv``) started together."""
    for work in works:
        work.wait()


_INTS = "__ddpjob_ints__"  # a long list of ints, as one tensor: {_INTS: tensor, "tuple": bool}


def _compact(obj: Any) -> Any:
    """``obj`` with each long list or tuple of ints (the Python and NumPy RNG states: ~1,250 ints) as one int64
    tensor: ``torch.save`` calls its persistent-id hook once per pickled object, 1.6 ms of a copy's 2 ms here."""
    if isinstance(obj, dict):
        return {key: _compact(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        if len(obj) >= 64 and all(type(x) is int for x in obj):
            try:
                return {_INTS: torch.tensor(obj, dtype=torch.int64), "tuple": isinstance(obj, tuple)}
            except (OverflowError, RuntimeError):  # an int beyond 64 bits: kept as it is
                pass
        items = [_compact(value) for value in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _expand(obj: Any) -> Any:
    if isinstance(obj, dict):
        if _INTS in obj:
            ints = obj[_INTS].tolist()
            return tuple(ints) if obj["tuple"] else ints
        return {key: _expand(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_expand(value) for value in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def pack(obj: Any) -> bytes:
    """A train-state part as bytes: small, immutable, and what the copy's staging need not walk."""
    buffer = io.BytesIO()
    torch.save(_compact(obj), buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    # weights_only=True: a copy can never run code on load, as a checkpoint.
    return _expand(loadable.load(io.BytesIO(data)))


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


_HEADER = 8  # a framed part's length, little-endian, before its bytes
_SLOT = 4096  # slots grow in steps of this


def _framed(own: bytes, slot: int) -> torch.Tensor:
    framed = torch.zeros(_HEADER + slot, dtype=torch.uint8)
    framed[:_HEADER] = _as_tensor(len(own).to_bytes(_HEADER, "little"))
    if len(own) <= slot:
        framed[_HEADER : _HEADER + len(own)] = _as_tensor(own)
    return framed


def _unframed(framed: torch.Tensor) -> tuple[int, bytes]:
    data = framed.numpy().tobytes()
    size = int.from_bytes(data[:_HEADER], "little")
    return size, data[_HEADER : _HEADER + size]


class Parts:
    """Collective over the tier's group, once per copy: the ranks' packed train-state parts, by rank: every rank's
    (``every``: a full-state copy's), or rank 0's and this rank's (a sharded one's). Each part travels framed in a
    slot of the size the last copy needed, so a copy takes one all-gather (or broadcast); a part that outgrew it is
    sent again in a larger slot, which every rank learns of from the same lengths."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.slot = 0  # the same on every rank: set from lengths every rank received

    def gather(self, own: bytes, every: bool) -> dict[int, bytes]:
        if self.group is None:
            return {self.rank: own}
        while True:
            if every:
                parts = [torch.empty(_HEADER + self.slot, dtype=torch.uint8) for _ in range(self.world)]
                dist.all_gather(parts, _framed(own, self.slot), group=self.group)
                found = dict(enumerate(_unframed(part) for part in parts))
            else:
                empty = torch.empty(_HEADER + self.slot, dtype=torch.uint8)
                first = _framed(own, self.slot) if self.rank == 0 else empty
                dist.broadcast(first, 0, group=self.group)
                found = {0: _unframed(first)}
            longest = max(size for size, _ in found.values())
            if longest <= self.slot:
                return {r: data for r, (_, data) in found.items()} | ({} if every else {self.rank: own})
            self.slot = -(-longest // _SLOT) * _SLOT


class Ring:
    """One rank's part of the replication: send to ``following``, receive from ``previous`` (either may be None)."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        following: Optional[int],
        previous: Optional[int],
        group: Optional[dist.ProcessGroup],
        keep: int,
    ) -> None:
        self.folder, self.rank, self.following, self.previous = folder, rank, following, previous
        self.group, self.keep = group, keep

    def exchange(self, step: int, info: Optional[store.CheckpointInfo]) -> None:
        """In the writer's thread, after the copy of ``step`` (None: its write failed): the copy goes to the next
        node, the previous node's arrives and is kept."""
        payload = b""
        manifest = b""
        if info is not None and self.following is not None:
            assert isinstance(info.path, Path), "the node-local tier is a local folder"
            manifest = info.path.with_suffix(".json").read_bytes()
            payload = manifest + info.path.read_bytes()
        header = torch.tensor([step, len(manifest), len(payload)], dtype=torch.int64)
        received = torch.zeros(3, dtype=torch.int64)
        works = []
        if self.following is not None:
            works.append(dist.isend(header, self.following, group=self.group))
        if self.previous is not None:
            works.append(dist.irecv(received, self.previous, group=self.group))
        wait_all(works)
        works = []
        if payload:
            assert self.following is not None
            sent = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            works.append(dist.isend(sent, self.following, group=self.group))
        incoming = torch.empty(int(received[2]), dtype=torch.uint8)
        if self.previous is not None and incoming.numel():
            works.append(dist.irecv(incoming, self.previous, group=self.group))
        wait_all(works)
        if incoming.numel():
            assert self.previous is not None
            self._keep(int(received[0]), int(received[1]), incoming.numpy().tobytes())

    def _keep(self, step: int, manifest_size: int, payload: bytes) -> None:
        """The previous node's copy of ``step``, kept as its sender wrote it: data first, manifest last."""
        folder = self.folder / f"rank-{self.previous}"
        private.makedirs(folder)  # in the node's private folder: 0700, the files 0600
        final = folder / f"step_{step:08d}.pt"
        tmp = folder / f".step_{step:08d}.pt.tmp{os.getpid()}"
        with open(tmp, "wb", opener=private.opener) as f:
            f.write(memoryview(payload)[manifest_size:])
        final.with_suffix(".json").unlink(missing_ok=True)
        os.replace(tmp, final)
        fsync_dir(folder)
        atomic_write_text(final.with_suffix(".json"), payload[:manifest_size].decode(), private=True)
        store.prune(folder, self.keep)
        log.debug("kept rank %d's local copy of step %d", self.previous, step)
