"""A node that a trial of a sweep excludes is excluded for the sweep's later trials: a grid sweep's array tasks and an
adaptive search's workers each watch their trials' failures as a single run's batch script does (docs/failures.md).

The cluster alone (tests/support/cluster_guard.py): every job takes one CPU on each of two nodes of partition "wide"
(n1-n3), which Slurm places on n1 and n2 (n3 has the higher weight), and the failure is a trial's rank on n2 killed
once Slurm has drained n2 (tests/support/bad_node.py: the drain is the evidence a node is excluded on)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import optuna

from ddp_core.cluster.env import expand_nodelist
from ddp_core.search.study import open_study
from tests.support.bad_node import drain_and_kill, undrain
from tests.support.cli_runner import field, run_cli
from tests.support.digits import DIGITS, TWO
from tests.support.helpers import events, wait_for

# The cluster alone: each test needs its job placed on n2 (n1 and n2 weigh least), and beside another lane a job of that
# lane still completing on n2 kept a retry off it once (slurmctld placed it on n1 and n3 a second after the other
# job's kill), so the trial completed and nothing was excluded.


def halting(halted: Path) -> list[str]:
    """A trial's rank on n2 halts at its 25th batch, for the test to drain n2 and kill it (``bad_node``)."""
    return ["task.target=tests.support.tasks:CrashingTask", "task.data.crash_host=n2", "task.data.crash_at=25",
            "task.data.error=HALT", f"task.data.halt_file={halted}"]  # fmt: skip


def test_a_node_a_trial_excluded_is_excluded_for_the_sweeps_later_trials(slurm_cluster, tmp_path):
    """A sweep's array task watches its trial's attempts as a single run's batch script does: trial 0's rank on n2
    dies at its 25th batch once Slurm has drained n2, so trial 0 excludes n2 and completes on n1 and n3. Trial 1, held
    in the queue meanwhile (``scontrol hold``: the array's order stays the test's), has taken the exclusion from the
    array and, once released, runs on n1 and n3 with no failure."""
    halted = tmp_path / "halted"
    proc = run_cli("sweep", DIGITS, *TWO, *halting(halted), "slurm.array_parallelism=1", "train.seed=0,1", "--name",
                   "bad-node", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array = field(proc.stdout, "arrays").split()[0]
    held = subprocess.run(["scontrol", "hold", f"{array}_1"], capture_output=True, text=True)
    assert held.returncode == 0, held.stderr
    sweep_dir = Path(field(proc.stdout, "dir"))
    trials = {int(yaml_seed(p)): p.parent for p in sweep_dir.glob("*/config.yaml")}
    first, second = trials[0], trials[1]
    try:
        drain_and_kill(halted, "n2")
        wait_for(lambda: any(e["event"] == "completed" for e in events(first)), 240, "trial 0 to complete", poll=1)
    finally:
        undrain("n2")
    seen = [(e["event"], e.get("host")) for e in events(first) if e["event"] in ("failure", "excluded", "completed")]
    assert seen == [("failure", "n2"), ("excluded", "n2"), ("completed", None)], seen
    shown = subprocess.run(["scontrol", "show", "job", f"{array}_1"], capture_output=True, text=True).stdout
    assert "ExcNodeList=n2" in shown and "JobState=PENDING" in shown, shown
    subprocess.run(["scontrol", "release", f"{array}_1"], check=True)
    wait_for(lambda: any(e["event"] == "completed" for e in events(second)), 240, "trial 1 to complete", poll=1)
    assert [e["event"] for e in events(second)] == ["start", "completed"], events(second)
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "NodeList", "-j", f"{array}_1"],
                          capture_output=True, text=True).stdout.split()  # fmt: skip
    assert rows == ["n[1,3]"], rows


def yaml_seed(config: Path) -> str:
    return re.search(r"^  seed: (\d+)$", config.read_text(), re.M)[1]  # type: ignore[index]


def test_a_search_trial_retries_its_step_then_moves_its_worker_off_the_bad_node(slurm_cluster, tmp_path):
    """An adaptive search's worker runs each trial as an srun step of its allocation (n2 and another node): the
    first trial's rank on n2 dies at its 25th batch once Slurm has drained n2. The worker cannot restart the step in
    place without n2, so it excludes n2 and requeues itself off it; its next attempt, on n1 and n3, resumes the trial
    from its checkpoint, and the search completes both trials."""
    halted = tmp_path / "halted"
    proc = run_cli("sweep", DIGITS, *TWO, *halting(halted), "optim.lr=loguniform(1e-3,1e-2)", "--search", "random",
                   "--trials", "2", "--parallel", "1", "--name", "bad-node-search", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep, array = Path(field(proc.stdout, "dir")), field(proc.stdout, "arrays").split()[0]

    def trials() -> list[optuna.trial.FrozenTrial]:
        return open_study(sweep)[1].get_trials()

    try:
        drain_and_kill(halted, "n2")
        wait_for(lambda: len(trials()) == 2 and all(t.state.is_finished() for t in trials()), 300, "2 trials", poll=2)
    finally:
        undrain("n2")
    assert [t.state for t in trials()] == [optuna.trial.TrialState.COMPLETE] * 2, [t.user_attrs for t in trials()]
    first = sweep / "t0000"
    seen = [(e["event"], e.get("kind"), e.get("host")) for e in events(first) if e["event"] != "rank_failed"]
    assert seen == [
        ("start", None, None), ("failure", "infrastructure", "n2"), ("excluded", None, "n2"),
        ("requeued", "failure", None), ("start", None, None), ("completed", None, None),
    ], seen  # fmt: skip
    assert [e["event"] for e in events(sweep / "t0001")] == ["start", "completed"]
    # One worker is an array of one task (task 0), as the search's every generation is: submitit's array log name.
    worker_log = (sweep / "slurm" / f"{array}_0_0_log.err").read_text()
    assert re.search(rf"job {array}\S* excludes n2", worker_log), worker_log

    def attempts() -> list[str]:
        return subprocess.run(["sacct", "-n", "-P", "-D", "-X", "-o", "State,NodeList", "-j", array],
                              capture_output=True, text=True).stdout.split()  # fmt: skip

    # The worker's job ends after the search's last trial is recorded (CI once read it still RUNNING): its end first.
    rows = wait_for(lambda: (r := attempts()) and r[-1].split("|")[0] not in ("RUNNING", "PENDING", "COMPLETING") and r,
                    60, "the worker's job to end")  # fmt: skip
    # The first attempt had n2 (and n1: the cluster is this test's alone, and n1 and n2 weigh least).
    assert len(rows) == 2 and rows[0].startswith("REQUEUED|"), rows
    assert "n2" in expand_nodelist(rows[0].split("|")[1]) and rows[1] == "COMPLETED|n[1,3]", rows
