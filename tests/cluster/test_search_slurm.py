"""Adaptive sweeps on the local cluster: workers are array tasks, each trial an srun step of the normal trainer."""

from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path

import optuna
import pytest

from ddp_core.search.study import open_study
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, digests, events, final_digests, rank_logs, run_trainer, wait_for, wait_gone

DIGITS = str(ROOT / "configs" / "digits.yaml")
SMALL = ["slurm.tasks_per_node=1", "train.max_steps=40", "train.eval_every=10", "train.log_every=10",
         "checkpoint.every_steps=20", "wandb.mode=disabled", "--no-snapshot"]  # fmt: skip
# W&B stays off: its offline start costs seconds of CPU per trial, and the trials of two searches share 2 cores.


def study_trials(sweep: Path) -> list[optuna.trial.FrozenTrial]:
    return open_study(sweep)[1].get_trials()


def finished(sweep: Path, count: int) -> bool:
    trials = study_trials(sweep)
    return len(trials) == count and all(t.state.is_finished() for t in trials)


def submit(tmp_path: Path, *args: str) -> tuple[Path, str]:
    proc = run_cli("sweep", DIGITS, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Path(field(proc.stdout, "dir")), field(proc.stdout, "arrays")


def test_tpe_search_beats_the_median_random_trial(slurm_cluster, tmp_path):
    # 9 trials each (3 rounds of 3 workers; TPE's first 3 at random): were TPE no better than random, its best would
    # miss the random median 1.5% of the time (12 each: 0.3%); each trial is a torch process.
    space = ["optim.lr=loguniform(1e-4,3e-1)", "task.model.hidden=range(16,257,16)", "--trials", "9", "--parallel",
             "3", "--seed", "1", *SMALL]  # fmt: skip
    started = time.monotonic()
    tpe, tpe_array = submit(tmp_path, "--search", "tpe", "--name", "tpe", *space)
    rnd, rnd_array = submit(tmp_path, "--search", "random", "--name", "rnd", *space)
    for sweep in (tpe, rnd):
        wait_for(lambda sweep=sweep: finished(sweep, 9), 600, f"{sweep.name}'s 9 trials", poll=2)
    print(f"two 9-trial searches (parallelism 3 each, concurrently) took {time.monotonic() - started:.0f} s")
    for sweep in (tpe, rnd):
        trials = study_trials(sweep)
        assert [t.number for t in trials] == list(range(9))
        assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials), [t.user_attrs for t in trials]
        assert sorted(p.name for p in sweep.glob("t*/config.yaml") for p in [p.parent]) == [f"t{i:04d}" for i in
                                                                                           range(9)]  # fmt: skip
        for t in trials:  # the binding: trial number <-> run directory <-> its completed event's value
            final = events(Path(t.user_attrs["run_dir"]), "completed")[-1]["final"]
            assert final["loss"] == t.value
    best_tpe = min(t.value for t in study_trials(tpe))
    median_random = statistics.median(t.value for t in study_trials(rnd))
    print(f"best TPE eval/loss {best_tpe:.4f}, median random {median_random:.4f}")
    assert best_tpe <= median_random
    status = run_cli("status", str(tpe), cwd=tmp_path)
    assert "9 complete" in status.stdout and "best:    trial" in status.stdout, status.stdout
    for array in (tpe_array, rnd_array):
        wait_gone(array, 120)


@pytest.mark.cluster_shared("b")  # 3 one-CPU workers: room beside lane a's 2-CPU jobs (tests/support/cluster_guard.py)
def test_pruning_and_a_requeued_worker_resuming_its_trial(slurm_cluster, tmp_path, pytestconfig):
    # Half the learning rates diverge: the median pruner stops those trials at an early eval.
    pruning, _ = submit(tmp_path, "--search", "random", "--pruner", "median", "--name", "prune", "--trials", "6",
                        "--parallel", "2", "--seed", "3", "optim.lr=choice(0.003,0.01,30.0,80.0)",
                        "train.stop_on_nan=false", *SMALL)  # fmt: skip
    slow = ["task.target=tests.support.tasks:SlowDigitsTask", "task.data.pause_s=0.03", "train.max_steps=200",
            "train.eval_every=50", "train.log_every=5", "checkpoint.every_steps=50", "slurm.tasks_per_node=1",
            "wandb.mode=disabled", "--no-snapshot"]  # fmt: skip
    requeue, array = submit(tmp_path, "--search", "random", "--name", "requeue", "--trials", "1", "--parallel", "1",
                            "optim.lr=choice(0.002,0.003)", *slow)  # fmt: skip
    trial = requeue / "t0000"
    wait_for(lambda: (trial / "metrics.jsonl").exists() and len(events(trial, "start")) == 1, 240, "trial start")
    time.sleep(1.5)
    job = events(trial, "start")[0]["job_id"]
    subprocess.run(["scancel", "--signal=USR2", job], check=True)  # the step's ranks: the trainer, not the worker
    wait_for(lambda: finished(requeue, 1), 300, "the requeued trial to complete", poll=1)
    assert [e["event"] for e in events(trial)].count("requeued") == 1
    starts = events(trial, "start")
    assert len(starts) == 2 and starts[1]["step"] == events(trial, "interrupted")[0]["step"] > 0
    (only,) = study_trials(requeue)  # resumed, not re-sampled: one trial, its number and run directory kept
    assert only.state == optuna.trial.TrialState.COMPLETE and only.user_attrs["run_dir"] == str(trial)
    assert only.user_attrs["worker"] == "1:0"
    reference = final_digests(
        run_trainer(str(trial / "config.yaml"), tmp_path / "reference", ["trial.storage=null", "trial.number=-1"])
    )[-1]
    assert digests(rank_logs(trial, job)) == {0: reference}

    wait_for(lambda: finished(pruning, 6), 400, "the pruning search", poll=2)
    pruned = [t for t in study_trials(pruning) if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, [(t.params, t.state) for t in study_trials(pruning)]
    for t in pruned:
        run = Path(t.user_attrs["run_dir"])
        (event,) = events(run, "pruned")
        assert event["step"] < 40 and not events(run, "completed")
    saved = sum(40 - events(Path(t.user_attrs["run_dir"]), "pruned")[0]["step"] for t in pruned)
    print(f"pruning saved {saved} of {40 * 6} steps ({len(pruned)} trials pruned)")
    status = run_cli("status", str(pruning), cwd=tmp_path)
    assert f"{len(pruned)} pruned" in status.stdout and "PRUNED" in status.stdout, status.stdout
    wait_gone(array, 120)


@pytest.mark.cluster_shared("b")  # one 1-CPU worker
@pytest.mark.cluster_user  # as ddpjob-alice on the site profile (the user pass): her worker, her scancel
def test_a_search_whose_workers_died_continues_and_extends(slurm_cluster, tmp_path):
    # One worker; its array is cancelled while trial 0 runs (after a checkpoint). The rerun binds the orphaned trial
    # to the new generation, which resumes it from that checkpoint; --more 1 adds one trial after the budget is spent.
    args = ["--search", "random", "--name", "died", "--trials", "2", "--parallel", "1", "optim.lr=choice(0.002,0.003)",
            "task.target=tests.support.tasks:SlowDigitsTask", "task.data.pause_s=0.03", "train.max_steps=60",
            "train.eval_every=0", "train.log_every=10", "checkpoint.every_steps=10", "slurm.tasks_per_node=1",
            "wandb.mode=disabled", "--no-snapshot"]  # fmt: skip
    sweep, array = submit(tmp_path, *args)
    first = sweep / "t0000"
    wait_for(lambda: list((first / "checkpoints").glob("step_*.json")), 240, "trial 0's first checkpoint")
    subprocess.run(["scancel", array], check=True)  # the worker and its trial's step: nobody tells the study
    wait_gone(array, 120)
    (orphan,) = study_trials(sweep)
    assert orphan.state == optuna.trial.TrialState.RUNNING and orphan.user_attrs["worker"] == "1:0"

    _, rerun = submit(tmp_path, *args)  # the same command again: the study continues
    wait_for(lambda: finished(sweep, 2), 300, "the continued search", poll=1)
    wait_gone(rerun, 120)
    extended = run_cli("sweep", str(sweep), "--more", "1", cwd=tmp_path)
    assert extended.returncode == 0, extended.stdout + extended.stderr
    wait_for(lambda: finished(sweep, 3), 300, "the extended search", poll=1)

    trials = study_trials(sweep)
    assert [t.number for t in trials] == [0, 1, 2]  # nothing re-sampled, nothing lost
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials), [t.user_attrs for t in trials]
    assert trials[0].user_attrs["worker"] == "2:0" and trials[2].user_attrs["worker"] == "3:0"
    starts = events(first, "start")  # resumed in its own run directory, from the checkpoint
    assert len(starts) == 2 and starts[1]["step"] > 0, starts
    assert sorted(p.name for p in sweep.glob("t*")) == ["t0000", "t0001", "t0002"]
    wait_gone(field(extended.stdout, "arrays"), 120)
