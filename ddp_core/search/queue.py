"""The trial queue of a packed grid or random sweep: which trial each slot of each allocation runs next.

The login node (``jobs.sweeps.pack``) writes the queue, the pack's workers (``search.pack``) claim from it, all under
the lock the adaptive search's ask takes (``study.ask_lock``: an O_EXCL lock file, NFS-safe), so no trial runs twice and
none is skipped::

    SWEEP/pack.json     the trials in order (their run directories), each slot's srun line and size (login node)
    SWEEP/claims.json   run directory -> {"job": the allocation's job id, "state": running | completed | failed}

A claim is ``running`` from the moment a slot takes it until its trial ends; a trial handed on by a requeue stays
``running``, bound to its allocation's job id, and the requeued allocation (the same job id) takes it back first. The
login node frees the claims of allocations that are gone before it submits new ones (``release``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Optional

from ddp_core.run.rundir import atomic_write_text
from ddp_core.search.study import ask_lock

PACK_FILE = "pack.json"
CLAIMS_FILE = "claims.json"
ENDED = ("completed", "failed")


def read_pack(sweep: Path) -> dict[str, Any]:
    return dict(json.loads((sweep / PACK_FILE).read_text()))


def write_pack(sweep: Path, pack: Mapping[str, Any]) -> None:
    atomic_write_text(sweep / PACK_FILE, json.dumps(pack, indent=1, sort_keys=True) + "\n")


def read_claims(sweep: Path) -> dict[str, dict[str, Any]]:
    path = sweep / CLAIMS_FILE
    return dict(json.loads(path.read_text())) if path.exists() else {}


def write_claims(sweep: Path, claims: Mapping[str, Any]) -> None:
    atomic_write_text(sweep / CLAIMS_FILE, json.dumps(claims, indent=1, sort_keys=True) + "\n")


def claim(sweep: Path, job: str, held: Collection[str] = ()) -> Optional[str]:
    """The next trial for a slot of allocation ``job``: one of its own handed-on trials that no slot of it holds
    (``held``), else the first trial nobody claimed; None when the queue has no more for it."""
    with ask_lock(sweep):
        trials, claims = read_pack(sweep)["trials"], read_claims(sweep)
        own = [t for t in trials if claims.get(t, {}).get("state") == "running" and claims[t].get("job") == job]
        pick = next((t for t in own if t not in held), None)
        if pick is None:
            pick = next((t for t in trials if t not in claims), None)
        if pick is not None:
            claims[pick] = {"job": job, "state": "running"}
            write_claims(sweep, claims)
        return pick


def finish(sweep: Path, trial: str, state: str) -> None:
    """Trial ``trial`` ended: ``completed`` or ``failed`` (its run directory says how)."""
    assert state in ENDED, state
    with ask_lock(sweep):
        claims = read_claims(sweep)
        claims[trial] = {**claims.get(trial, {}), "state": state}
        write_claims(sweep, claims)


def release(sweep: Path, alive: Callable[[str], bool], again: Collection[str] = ()) -> list[str]:
    """Free the claims of allocations that are gone (``alive(job)`` is False) and of the trials in ``again`` (a rerun
    of the sweep runs its failed trials again); returns the trials freed. The caller holds no lock."""
    with ask_lock(sweep):
        claims = read_claims(sweep)

        def freed_one(trial: str, c: dict[str, Any]) -> bool:
            if c.get("state") == "running":
                return not alive(str(c.get("job")))
            return c.get("state") == "failed" and trial in again

        freed = [t for t, c in claims.items() if freed_one(t, c)]
        for t in freed:
            del claims[t]
        write_claims(sweep, claims)
        return freed


def add_trials(sweep: Path, trials: list[str], pack: Mapping[str, Any]) -> None:
    """The login node's queue: ``pack`` (steps, slot sizes) with ``trials`` appended to those it had, in order."""
    with ask_lock(sweep):
        known = read_pack(sweep)["trials"] if (sweep / PACK_FILE).exists() else []
        write_pack(sweep, {**pack, "trials": [*known, *(t for t in trials if t not in known)]})
