"""Packed sweeps on the local cluster (``ddpjob sweep --pack``, docs/sweeps.md): trials side by side in the slots of
one allocation of a whole node, interrupted and failing from inside a trial at a chosen batch. The slot counts below
are those of the first pass's cluster (partition "local": two nodes of 4 CPUs); the site profile's nodes have 2.

- The allocation's warning signal mid-trial: every running trial saves and defers its requeue to the pack, the
  allocation is requeued once, and every trial, those interrupted and the one that had not started, ends bitwise on
  its single run's reference.
- A trial that SIGKILLs itself beside healthy ones (no restart or failure budget): only it fails, the others complete,
  and its slot runs the next trial.
(The queue, the slots' steps and the pack's sizing without a cluster: tests/unit/ddp_core/search/test_pack.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.support import storm
from tests.support.cli_runner import field, run_cli
from tests.support.digits import DIGITS
from tests.support.helpers import digests, events, rank_logs, two_rank_reference, wait_for, wait_gone

RATES = ["0.01", "0.02", "0.05"]
SIGNALLED = [
    "task.target=tests.support.pack_tasks:PackSignalDigitsTask",
    "task.data.signal_at=15",
    "train.stop_check_ms=0",
]
RUN = ["train.max_steps=40", "checkpoint.every_steps=10", "train.eval_every=0", "wandb.mode=disabled"]


def sweep(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[Path, str]:
    """``ddpjob sweep ARGS`` submitted: (the sweep directory, the pack's array job id)."""
    proc = run_cli("sweep", DIGITS, *args, "--name", "packed", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Path(field(proc.stdout, "dir")), field(proc.stdout, "arrays")


def trials(root: Path) -> dict[str, dict]:
    """Each trial's run directory name -> its claim (allocation job, state)."""
    return {Path(t).name: c for t, c in json.loads((root / "claims.json").read_text()).items()}


def served(root: Path, array: str) -> dict[str, str]:
    """Each trial's run directory name -> the slot that ran it, from the pack's own log ("slot I (NODE): trial T")."""
    log = root / "slurm" / f"{array}_0_0_log.err"
    text = log.read_text() if log.exists() else ""
    return {m[2]: m[1] for m in re.finditer(r"pack (slot \d+) \(\S+\): trial (\S+)$", text, re.M)}


def test_the_allocations_warning_signal_requeues_it_once_and_every_trial_ends_on_its_single_runs_bits(
    pytestconfig, tmp_path_factory, tmp_path
):
    made = tmp_path_factory
    refs = {
        lr: two_rank_reference(pytestconfig, made, f"pack-{lr}", DIGITS, [*SIGNALLED, *RUN, f"optim.lr={lr}"])
        for lr in RATES
    }  # fmt: skip
    root, array = sweep(tmp_path, *SIGNALLED, *RUN, f"optim.lr={','.join(RATES)}", "--pack", "1")
    assert wait_gone(f"{array}_0", 600) == "COMPLETED"
    claims = trials(root)
    assert len(claims) == 3 and {c["state"] for c in claims.values()} == {"completed"}, claims
    deferred = 0
    for name in claims:
        run = root / name
        config = (run / "config.yaml").read_text()
        lr = next(r for r in RATES if re.search(rf"\blr: {r}\b", config))
        recorded = events(run)
        kinds = [e["event"] for e in recorded]
        if "interrupted" in kinds:  # the two that ran when the signal came (each flags it every step): saved,
            # deferred, requeued by the pack
            deferred += 1
            assert ["interrupted", "requeue_deferred", "requeued_by_batch"] == [
                k for k in kinds if k in ("interrupted", "requeue_deferred", "requeued_by_batch")
            ], recorded
        assert kinds[-1] == "completed" and "failure" not in kinds, recorded
        job = str(json.loads((run / "run.json").read_text())["jobs"][-1]["job_id"])
        assert set(digests(rank_logs(run, job)).values()) == {refs[lr]}, (name, lr)
    assert deferred == 2  # the allocation's two slots, each running a trial
    requeues = [e for name in claims for e in events(root / name, "requeued_by_batch")]
    assert len({e["job_id"] for e in requeues}) == 1  # one allocation, requeued once for both


def test_a_trial_that_kills_itself_fails_alone_and_its_slot_runs_the_next_trial(tmp_path):
    """Four slots (trials of one task on a 4-CPU node), five trials: the first kills itself at its 6th batch, the
    others hold at their 10th until the test has seen the killed trial's slot take the fifth trial."""
    crash = ["task.target=tests.support.pack_tasks:HeldCrashingTask", "task.data.crash_rank=0", "task.data.hold_at=10"]
    budgets = ["slurm.max_restarts=0", "slurm.max_failures=0", "slurm.tasks_per_node=1", "task.data.error=SIGKILL"]
    at = "task.data.crash_at=6,1000,1001,1002,1003"
    gate = tmp_path / "gate"
    gate.mkdir()
    root, array = sweep(tmp_path, *crash, *budgets, *RUN, at, "--pack", "1", env={"DDPJOB_TEST_PACK_GATE": str(gate)})
    wait_for(lambda: len(served(root, array)) == 5, 300, "a slot taking the fifth trial")
    (gate / "go-hold").touch()
    assert wait_gone(f"{array}_0", 600) == "COMPLETED"
    claims = trials(root)
    states = {name: c["state"] for name, c in claims.items()}
    crashed = [name for name in claims if "crash_at: 6\n" in (root / name / "config.yaml").read_text()]
    assert len(crashed) == 1 and states.pop(crashed[0]) == "failed", claims
    assert set(states.values()) == {"completed"} and len(states) == 4, claims
    (failure,) = events(root / crashed[0], "failure")
    assert (failure["kind"], failure["rank"]) == ("infrastructure", 0), failure
    assert events(root / crashed[0])[-1]["event"] == "budget_exhausted"
    for name in states:  # the healthy ones: no failure of theirs, whatever their neighbour did
        assert not events(root / name, "failure") and events(root / name)[-1]["event"] == "completed"
    shown = run_cli("status", str(root), cwd=tmp_path)  # each trial's own state, not its allocation's
    assert f"pack:    arrays {array}, 4 slots a node; 0 slots busy" in shown.stdout, shown.stdout + shown.stderr
    assert "trials:  0 pending, 0 running, 4 completed, 1 failed" in shown.stdout, shown.stdout
    assert re.search(rf"FAILED .*{crashed[0]}", shown.stdout), shown.stdout
    logs = run_cli("logs", str(root / crashed[0]), cwd=tmp_path)  # a trial's own ranks' logs, as any run's
    assert logs.returncode == 0 and re.search(r"slurm on n\d: rank 0/1 ", logs.stdout), logs.stdout + logs.stderr
    said = r"\[worker\] ERROR ddp_core: requeue budget exhausted after 1 failure \(slurm.max_failures=0\); continue"
    assert re.search(said, logs.stdout), logs.stdout  # the pack's decision, in the trial's own log too
    report = run_cli("report", str(root), "--metric", "min:train/loss", cwd=tmp_path)
    assert report.returncode == 0 and Path(field(report.stdout, "html")).exists(), report.stdout + report.stderr
    slots = served(root, array)
    after = [name for name, slot in slots.items() if slot == slots[crashed[0]] and name != crashed[0]]
    assert after, f"the crashed trial's {slots[crashed[0]]} ran nothing after it: {slots}"


def test_a_packed_adaptive_search_honours_its_budget_exactly_and_prunes(tmp_path):
    """A random search of 7 trials with the median pruner, its workers the 4 slots of one allocation (trials of one
    task on a 4-CPU node): exactly 7 trials, each run once in a run directory of its own, the diverging ones pruned,
    every one told to the study, and no slot asked past the budget."""
    import optuna

    from ddp_core.search.study import open_study

    space = ["--search", "random", "--pruner", "median", "--trials", "7", "--parallel", "4", "--seed", "3",
             "optim.lr=choice(0.003,0.01,30.0,80.0)", "train.stop_on_nan=false", "slurm.tasks_per_node=1",
             "train.max_steps=40", "train.eval_every=10", "train.log_every=10", "wandb.mode=disabled"]  # fmt: skip
    root, array = sweep(tmp_path, *space, "--pack", "1")
    assert wait_gone(f"{array}_0", 600) == "COMPLETED"
    trials = open_study(root)[1].get_trials()
    assert [t.number for t in trials] == list(range(7)), trials  # the budget: neither more nor fewer
    assert all(t.state.is_finished() for t in trials), [(t.number, t.state) for t in trials]
    assert sorted(p.name for p in root.glob("t*") if (p / "config.yaml").exists()) == [f"t{i:04d}" for i in range(7)]
    workers = {t.user_attrs["worker"] for t in trials}
    assert workers <= {f"1:0/{slot}" for slot in range(4)} and len(workers) > 1, workers  # the slots, side by side
    states = {t.state for t in trials}
    assert optuna.trial.TrialState.COMPLETE in states and optuna.trial.TrialState.PRUNED in states, states
    for t in trials:  # one start per trial: none ran twice
        assert len(events(Path(t.user_attrs["run_dir"]), "start")) == 1, t.number
    shown = run_cli("status", str(root), cwd=tmp_path)
    assert "7/7 trials asked" in shown.stdout, shown.stdout + shown.stderr


def test_cancelling_a_packed_sweep_ends_every_allocation_and_a_rerun_finishes_its_trials(tmp_path):
    """Three trials in three allocations of one slot (trials of 4 CPUs on 4-CPU nodes, two nodes: one allocation
    pending): ``ddpjob cancel SWEEP`` ends all three, the running trials saving as a cancelled run does; running the
    same sweep again frees the claims of the cancelled allocations, and every trial completes, the cancelled ones from
    their saves."""
    held = ["task.target=tests.support.pack_tasks:HeldCrashingTask", "task.data.crash_at=1000", "task.data.hold_at=10"]
    args = [*held, *RUN, "slurm.tasks_per_node=2", "slurm.cpus_per_task=2", "optim.lr=0.01,0.02,0.05"]
    gate = tmp_path / "gate"
    gate.mkdir()
    env = {"DDPJOB_TEST_PACK_GATE": str(gate)}
    root, array = sweep(tmp_path, *args, "--pack", "3", env=env)
    wait_for(lambda: (gate / "at-hold").exists(), 300, "a trial at its 10th batch")
    cancel = run_cli("cancel", str(root), cwd=tmp_path)
    assert cancel.returncode == 0 and f"cancelled {array}" in cancel.stdout, cancel.stdout + cancel.stderr
    (gate / "go-hold").touch()  # the held ranks go on to the cancel's stop
    for task in range(3):
        assert wait_gone(f"{array}_{task}", 300).startswith("CANCELLED")
    cancelled = {name for name in trials(root) if events(root / name, "interrupted")}
    assert cancelled and all(events(root / n, "interrupted")[-1]["kind"] == "cancelled" for n in cancelled)
    again, second = sweep(tmp_path, *args, "--pack", "1", env=env)
    assert second != array
    assert wait_gone(f"{second}_0", 600) == "COMPLETED"
    assert {c["state"] for c in trials(again).values()} == {"completed"}, trials(again)
    for name in cancelled:  # resumed from the newest checkpoint before the rerun (the cancel's save, if it made one)
        assert len(events(again / name, "start")) == 2 and not storm.lost_steps(again / name), events(again / name)
