"""Restoring from the node-local tier at an attempt's start: which copy, from where, and loading it.

Collective, on every rank (``restore``):

1. Each rank checks its node's folders are this user's alone (``ddp_core.run.private``; else it reports nothing),
   then verifies its share of its node's copies (``store.verify``: size and checksum; the node's folders are
   split among its ranks) newer than the newest durable checkpoint, and reports them (step, checksum, per key: a
   full-state node copy is ``full``, a sharded copy its rank).
2. Every rank gets every report (one all-gather) and picks the same step: the newest for which every rank's key
   (``full``, or its own rank) is held by some rank. A full-state copy held by any node serves every rank.
3. A rank whose own node holds its key reads the file there; any other (a node that replaced a dead one, a rank
   whose node lost its copy) receives the file from the lowest rank holding it, over the tier's gloo group.
4. Each rank checks the bytes against the holder's checksum and loads them (``weights_only=True``); one more
   all-gather says whether every rank succeeded, else every rank falls back to the durable checkpoint.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ddp_core.checkpoint import loadable, store
from ddp_core.checkpoint.local import FULL_FOLDER, LocalTier, sharded_folder
from ddp_core.checkpoint.local_replica import wait_all
from ddp_core.distributed import collectives

log = logging.getLogger(__name__)

# A report: {"host": HOST, "copies": {KEY: {STEP: (algorithm, digest)}}}, KEY "full" or a rank (as text).
Report = dict[str, Any]


@dataclass(frozen=True)
class Source:
    """Where a rank gets its copy of the agreed step: ``holder`` (a rank on its own node reads it itself)."""

    key: str
    holder: int
    local: bool
    algorithm: str
    digest: str


def _subfolder(tier: LocalTier, key: str) -> str:
    return FULL_FOLDER if key == "full" else sharded_folder(tier.env.world_size, int(key))


def _keys(tier: LocalTier) -> list[str]:
    """The keys of this node's folders, in order: every rank of the node lists the same."""
    if tier.kind == store.FULL:
        return ["full"] if (tier.node / FULL_FOLDER).is_dir() else []
    world = tier.node / f"w{tier.env.world_size}"
    found = [p.name.removeprefix("rank-") for p in world.glob("rank-*")] if world.is_dir() else []
    return sorted((k for k in found if k.isdigit() and int(k) < tier.env.world_size), key=int)


def report(tier: LocalTier, newer_than: int) -> Report:
    """This rank's share of its node's verified copies newer than ``newer_than``; none from a node folder that is
    not this user's alone (``LocalTier.refusal``: a planted copy is never restored)."""
    mine = tier.node_ranks.index(tier.env.rank)
    copies: dict[str, dict[int, tuple[str, str]]] = {}
    refused = tier.refusal()
    if refused is not None:
        log.warning("node-local copies skipped: %s", refused.message)
        return {"host": tier.host, "copies": copies}
    for key in _keys(tier)[mine :: len(tier.node_ranks)]:
        folder = tier.node / _subfolder(tier, key)
        for manifest in sorted(folder.glob("step_*.json"), reverse=True):
            named = manifest.stem.removeprefix("step_")
            if not named.isdigit() or int(named) <= newer_than:
                continue  # the durable checkpoint is as new: not worth reading
            info = store.verify(manifest)
            if info is not None:
                copies.setdefault(key, {})[info.step] = store.recorded_checksum(manifest)
    return {"host": tier.host, "copies": copies}


def agree(tier: LocalTier, reports: list[Report]) -> Optional[tuple[int, dict[int, Source]]]:
    """The newest step every rank can get, and each rank's source; None without one. The same on every rank."""
    world = len(reports)
    keys = ["full"] * world if tier.kind == store.FULL else [str(r) for r in range(world)]
    steps = sorted({s for rep in reports for held in rep["copies"].values() for s in held}, reverse=True)
    for step in steps:
        sources: dict[int, Source] = {}
        for rank, key in enumerate(keys):
            holders = [h for h, rep in enumerate(reports) if step in rep["copies"].get(key, {})]
            if not holders:
                break
            near = [h for h in holders if reports[h]["host"] == reports[rank]["host"]]
            holder = (near or holders)[0]
            algorithm, digest = reports[holder]["copies"][key][step]
            sources[rank] = Source(key, holder, bool(near), algorithm, digest)
        else:
            return step, sources
    return None


def _send_and_receive(tier: LocalTier, step: int, sources: dict[int, Source]) -> Optional[bytes]:
    """Collective over the tier's group: the files this rank holds for ranks on other nodes go out; its own copy
    arrives if another node holds it. Returns what arrived (None: this rank reads its own node's file)."""
    name = f"step_{step:08d}.pt"
    outgoing = {
        dst: tier.node / _subfolder(tier, src.key) / name
        for dst, src in sorted(sources.items())
        if src.holder == tier.env.rank and not src.local
    }
    mine = sources[tier.env.rank]
    if not outgoing and mine.local:
        return None
    files = {dst: torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8) for dst, path in outgoing.items()}
    size = torch.zeros(1, dtype=torch.int64)
    works = [dist.isend(torch.tensor([len(t)]), dst, group=tier.group) for dst, t in files.items()]
    if not mine.local:
        works.append(dist.irecv(size, mine.holder, group=tier.group))
    wait_all(works)
    works = [dist.isend(t, dst, group=tier.group) for dst, t in files.items()]
    data = torch.empty(int(size[0]), dtype=torch.uint8)
    if not mine.local:
        works.append(dist.irecv(data, mine.holder, group=tier.group))
    wait_all(works)
    return None if mine.local else data.numpy().tobytes()


def _load(tier: LocalTier, step: int, source: Source, received: Optional[bytes]) -> Optional[dict[str, Any]]:
    """The copy's state, checked against its holder's checksum; None (with a warning) if it does not match."""
    if received is None:
        path = tier.node / _subfolder(tier, source.key) / f"step_{step:08d}.pt"
        try:
            received = path.read_bytes()
        except OSError as err:
            log.warning("node-local copy %s unreadable: %s", path, err)
            return None
    if store.bytes_digest(received, source.algorithm) != source.digest:
        log.warning("node-local copy of step %d from rank %d: %s mismatch", step, source.holder, source.algorithm)
        return None
    try:
        # weights_only=True: a copy can never run code on load, as for the durable checkpoints.
        state: dict[str, Any] = loadable.load(io.BytesIO(received))
    except Exception as err:  # checksummed, so written so: a copy from another version of the code, say
        log.warning("node-local copy of step %d does not load: %s: %s", step, type(err).__name__, err)
        return None
    return state


def restore(tier: LocalTier, newer_than: int) -> Optional[tuple[int, dict[str, Any], str]]:
    """Collective: (step, this rank's copy, where it came from) of the newest copy every rank can get that is newer
    than ``newer_than`` (the newest durable checkpoint's step, -1 without one); None when there is none."""
    reports = collectives.gather_to_all(report(tier, newer_than))
    agreed = agree(tier, reports)
    if agreed is None:
        return None
    step, sources = agreed
    state = _load(tier, step, sources[tier.env.rank], _send_and_receive(tier, step, sources))
    if not all(collectives.gather_to_all(state is not None)):
        log.warning("node-local copy of step %d: not every rank could load it; using the durable checkpoint", step)
        return None
    assert state is not None
    source = sources[tier.env.rank]
    where = "this node" if source.local else f"rank {source.holder} on {reports[source.holder]['host']}"
    return step, state, where
