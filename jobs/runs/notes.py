"""The lines under ``ddpjob status``'s table, one run at a time: its newest hang (the rank suspected and why,
``ddp_core.trainer.watchdog``), its newest failure (who, where, what, and whether it was retried,
``ddp_core.cluster.failures``), the budget a stopped run spent, a checkpoint a full filesystem refused, the nodes it
excluded after failures (and the bad ones it could not do without), and a persistent straggler."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ddp_core.cluster.failures import excluded_hosts, memory_side, when
from ddp_core.cluster.policy import memory_fix
from ddp_core.run.diskfull import MAX_FAILED_SAVES
from ddp_core.trainer.watchdog import cause


def for_run(name: str, events: list[dict[str, Any]], straggler: Optional[dict[str, Any]]) -> list[str]:
    notes = []
    if hangs := [e for e in events if e["event"] == "hang"]:
        notes.append(f"hang in {name} after step {hangs[-1].get('step')}: {cause(str(hangs[-1].get('summary', '')))}")
    if found := [i for i, e in enumerate(events) if e["event"] == "failure"]:
        notes.append(failure_note(name, events[found[-1]], events[found[-1] + 1 :]))
    if (ended := [e for e in events if e["event"] != "rank_failed"]) and ended[-1]["event"] == "budget_exhausted":
        e = ended[-1]
        notes.append(f"stopped in {name} at step {e.get('step')}: {e.get('reason')}; `ddpjob resume` continues it, "
                     "with budgets of its own")  # fmt: skip
    saves = [e for e in events if e["event"] in ("save_failed", "save_recovered")]
    if saves and saves[-1]["event"] == "save_failed":  # a full or failing filesystem (ddp_core.run.diskfull)
        e = saves[-1]
        notes.append(
            f"checkpoint not saved in {name} at step {e.get('step')}: {e.get('error')} ({e.get('count')} in a row; "
            f"training goes on, requeued after {MAX_FAILED_SAVES})"
        )
    if excluded := excluded_hosts(events):
        notes.append(f"excluded in {name}: " + "; ".join(f"{host} ({why})" for host, why in excluded.items()))
    kept = {str(e.get("host")): str(e.get("reason")) for e in events if e["event"] == "not_excluded"}
    if kept := {host: why for host, why in kept.items() if host not in excluded}:
        notes.append(f"bad but kept in {name} (too few nodes without it): "
                     + "; ".join(f"{host} ({why})" for host, why in kept.items()))  # fmt: skip
    if straggler is not None:
        notes.append(straggler_note(name, straggler))
    if (fitted := memory_note(name, events)) is not None:
        notes.append(fitted)
    return notes


def memory_note(name: str, events: list[dict[str, Any]]) -> Optional[str]:
    """What the newest attempt did about memory (``ddp_core.trainer.redo``): under ``data.batch_size=auto`` the
    micro-batch its probe chose and each halving after it; under ``train.invariant`` the step from which it
    recomputed activations. None for a run that did neither."""
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    if not starts:
        return None
    # A strategy whose steps communicate (fsdp) records its shrink before its start: the attempt before ran out.
    before = events[starts[-2] + 1 if len(starts) > 1 else 0 : starts[-1]]
    start, after = events[starts[-1]], [e for e in before if e.get("restarted")] + events[starts[-1] :]
    if "micro_batch" not in start:
        again = next((e for e in after if e["event"] == "activations_recomputed"), None)
        if again is None:
            return None
        return f"activations recomputed from step {again.get('step')} in {name}, out of memory on {again.get('error')}"
    recomputed = ", activations recomputed" if start.get("activations_recomputed") else ""
    if shards := start.get("shards"):  # train.invariant: the run's first probe chose it, the later ones keep it
        kept = ", kept from the run's first probe" if start.get("kept") else ""
        recomputed += f", train.invariant's {shards} shards{kept}"
    note = (f"micro-batch in {name}: {start['micro_batch']} x {start.get('grad_accum')} a replica (data.batch_size="
            f"auto, probed in {start.get('probe_s', 0):.2f} s at step {start.get('step')}{recomputed})")  # fmt: skip
    for e in after:
        if e["event"] == "micro_batch_shrunk":
            note += f"; halved to {e.get('micro_batch')} {when(e.get('step'))}, out of memory on {e.get('error')}"
        elif e["event"] == "activations_recomputed":  # at the smallest micro-batch, before the end
            note += f"; activations recomputed {when(e.get('step'))} on, out of memory on {e.get('error')}"
    return note


def failure_note(name: str, e: dict[str, Any], after: Sequence[dict[str, Any]] = ()) -> str:
    if e.get("rank") is not None:
        who = f"rank {e.get('rank')} on {e.get('host')}"
    else:  # srun's report named no rank, or the whole node was lost (cluster.node_loss)
        who = f"node {e.get('host')}" if e.get("host") else "the job step"
    # What followed it: a restart in the same allocation (its ``restarted`` event), else a requeue.
    decided = (a for a in after if a["event"] in ("restarted", "requeued", "start", "failed", "budget_exhausted"))
    first = next(decided, None)
    restarted = first if first is not None and first["event"] == "restarted" else None
    then = f"restarted in the allocation on {','.join(restarted.get('nodes') or [])}" if restarted else "requeued"
    if first is not None and first["event"] == "budget_exhausted":
        then = "not requeued: its budget is spent"
    if e.get("kind") == "memory":
        side, what = memory_side(str(e.get("error"))), str(e.get("error")).removeprefix("out of memory: ")
        where = f"on {e.get('host')} (rank {e.get('rank')})" if e.get("rank") is not None else f"in {who}"
        fix = memory_fix(side, None)
        return f"out of {side} memory in {name} {when(e.get('step'))} {where}: {what} (not retried: give it {fix})"
    retried = "a user error, not retried" if e.get("kind") == "user" else f"{e.get('kind')}: {then}"
    return f"failure in {name} at step {e.get('step')}: {who}: {e.get('error')} ({retried})"


def straggler_note(name: str, s: dict[str, Any]) -> str:
    median, slowest = s.get("work_ms_median") or 0, s.get("work_ms_max") or 0
    ratio = f" (x{slowest / median:.1f})" if median else ""
    who = f"rank {s.get('straggler_rank')} on {s.get('slowest_host')}"
    return (
        f"straggler in {name}: {who}, {slowest:.1f} ms of its own work per step vs median "
        f"{median:.1f}{ratio} (step {s.get('step')})"
    )
