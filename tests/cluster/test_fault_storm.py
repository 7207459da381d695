"""A storm of mixed faults against one real run (issue 56): a seeded schedule (tests/support/storm.py) of killed and
stalled ranks, warning signals, requeues, Slurm's preemption, frozen and killed nodes, controller and accounting
restarts, a full filesystem and a stalled S3 server, each injected from outside at a gate the run reaches, some in
the first steps after a restart, during a save or while the job is requeued. The run must complete by itself within
its budgets, bitwise equal to an uninterrupted run, with every failure of the right kind, no step lost beyond the
newest complete checkpoint, and status and goodput telling what its events tell. A failure prints the seed and the
schedule; ``DDPJOB_STORM_SEED=N`` replays that seed alone. With tight budgets (tests/support/storm_budgets.py,
``DDPJOB_STORM_BUDGET_SEED=N``) the run must survive every fault until the one that spends a budget, and end there with
that budget's reason. (Each fault on its own: the other modules here; the
longer soak on the same harness: bench/storm.py.)"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from ddp_core.run.rundir import RunDir
from jobs.runs import goodput
from tests.support import storm, storm_budgets
from tests.support.cli_runner import field, run_cli
from tests.support.digits import DIGITS
from tests.support.helpers import digests, events, rank_logs, stop_server, two_rank_reference, wait_idle

pytestmark = pytest.mark.cluster_profile("preempt")  # preemption fills both nodes, node faults: the cluster alone
REPLAY = os.environ.get("DDPJOB_STORM_SEED", "")  # N, or N,M,...: those seeds instead of CI's
SEEDS = [int(seed) for seed in REPLAY.split(",")] if REPLAY else [12, 35]
FAULTS = 4
# With tight budgets (tests/support/storm_budgets.py): seed 5 is a kill restarted in the allocation (max_restarts=1),
# a kill of rank 0 requeued (the one failure of max_failures=1), then a preemption with max_preemptions=0.
BUDGET_SEEDS = [int(seed) for seed in os.environ.get("DDPJOB_STORM_BUDGET_SEED", "5").split(",")]


@pytest.fixture(scope="module")
def reference(pytestconfig, tmp_path_factory) -> str:
    overrides = [*storm.RUN, f"train.max_steps={storm.STEPS}"]
    return two_rank_reference(pytestconfig, tmp_path_factory, "fault-storm", DIGITS, overrides)


@pytest.fixture
def checkpoint_store(tmp_path, monkeypatch) -> Iterator[tuple[list[str], int | None]]:
    """For the "s3" setting: a real S3 server of this test's own (its pid is the stall's target) and its bucket."""
    from tests.support import s3 as s3_support

    proc, endpoint = s3_support.start_server(tmp_path / "moto.log")
    server = s3_support.S3(endpoint, f"ddpjob-{secrets.token_hex(4)}")
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir(server.bucket)
    try:
        yield [f"checkpoint.dir={server.url('ckpt')}"], proc.pid
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        stop_server(proc)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_run_survives_a_seeded_storm_of_faults_and_ends_bitwise(seed, reference, tmp_path, request):
    schedule = storm.plan(seed, FAULTS)
    print(schedule.describe())
    store, s3_pid = request.getfixturevalue("checkpoint_store") if schedule.setting == "s3" else ([], None)
    root = tmp_path / "runs" if store else storm.SMALL_FS / f"storm-{uuid.uuid4().hex[:8]}"
    gate = tmp_path / "gate"
    gate.mkdir()
    wait_idle()
    task = [f"task.data.gate_dir={gate}"]
    proc = run_cli("submit", DIGITS, *schedule.overrides(), *task, *store, f"run.root={root}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    world = storm.Storm(job_id, run_dir, gate, s3_pid)
    try:
        problems = weather(schedule, world, job_id, run_dir, reference)
        assert not problems, f"{schedule.describe()}\n" + "\n".join(problems)
        check_status(run_dir, tmp_path, schedule)
    finally:
        world.repair()
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("seed", BUDGET_SEEDS)
def test_a_run_that_spends_a_budget_in_a_storm_ends_with_that_reason_and_only_then(seed, reference, tmp_path):
    """The run survives every fault until the one that takes a budget past its limit, ends there with
    ``budget_exhausted`` naming that budget, has lost no step, and ``ddpjob resume`` finishes it bitwise."""
    schedule, budgets, spent = storm_budgets.draw(seed, 5)
    print(schedule.describe(), budgets)
    assert spent is not None, "a budget seed whose schedule spends no budget"
    root = storm.SMALL_FS / f"storm-{uuid.uuid4().hex[:8]}"
    gate = tmp_path / "gate"
    gate.mkdir()
    wait_idle()
    overrides = [*storm_budgets.overrides(schedule, budgets), f"task.data.gate_dir={gate}", f"run.root={root}"]
    proc = run_cli("submit", DIGITS, *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    world = storm.Storm(job_id, run_dir, gate)
    try:
        problems = []
        for fault in schedule.faults:
            try:
                problems += storm.check_recorded(world.inject(fault, ends=fault.index == spent.index))
            except AssertionError as err:  # the run ended before its budget was spent, or never reached the gate
                pytest.fail(f"{schedule.describe()} {budgets}\nfault {fault.index} ({fault.kind}): {err}")
        assert not problems, f"{schedule.describe()}\n" + "\n".join(problems)
        assert storm.final_state(job_id, 300) == "FAILED"
        ended = [e for e in events(run_dir) if e["event"] in storm.ENDS]
        assert [e["event"] for e in ended] == ["budget_exhausted"], ended
        assert ended[0]["reason"] == f"requeue budget exhausted {spent.reason(budgets)}", (ended, schedule.describe())
        assert not storm.lost_steps(run_dir), storm.lost_steps(run_dir)
        status = run_cli("status", str(run_dir), cwd=tmp_path)
        assert "BUDGET_EXHAUSTED" in status.stdout, status.stdout + status.stderr
        resumed = run_cli("resume", str(run_dir), "--wait", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert set(digests(rank_logs(run_dir, field(resumed.stdout, "job"))).values()) == {reference}
    finally:
        world.repair()
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def weather(schedule: storm.Schedule, world: storm.Storm, job_id: str, run_dir: Path, reference: str) -> list[str]:
    """Every fault of the schedule, then the run's end: what went wrong, each in a line."""
    problems, windows = [], 0
    for fault in schedule.faults:
        try:
            record = world.inject(fault)
        except AssertionError as err:  # the run ended, or never reached the gate
            return [*problems, f"fault {fault.index} ({fault.kind}): {err}"]
        problems += storm.check_recorded(record)
        windows += sum(e["event"] == "failure" for e in record.events)
    state = storm.final_state(job_id, 300)
    if state != "COMPLETED":
        return [*problems, f"job {job_id} ended {state}: {[e for e in events(run_dir) if e['event'] != 'start']}"]
    found = digests(rank_logs(run_dir, job_id))
    if set(found.values()) != {reference}:
        problems.append(f"final weights {found} differ from the uninterrupted run's {reference}")
    if (last := events(run_dir)[-1])["event"] != "completed":
        problems.append(f"the run's last event is {last}")
    if len(failures := events(run_dir, "failure")) != windows:  # one outside every fault's window: no fault's
        problems.append(f"{len(failures) - windows} failures recorded outside the faults' windows: {failures}")
    return problems + storm.lost_steps(run_dir)


def check_status(run_dir: Path, cwd: Path, schedule: storm.Schedule) -> None:
    """``ddpjob status`` and the goodput agree with the events: one launch per start, one requeue per requeued."""
    measured = goodput.of_run(RunDir(run_dir))
    assert measured is not None
    recorded = events(run_dir)
    assert measured.launches == sum(e["event"] == "start" for e in recorded), schedule.describe()
    assert measured.requeues == sum(e["event"] == "requeued" for e in recorded), schedule.describe()
    assert measured.restarts == sum(e["event"] == "restarted" for e in recorded), schedule.describe()
    status = run_cli("status", str(run_dir), cwd=cwd)
    assert status.returncode == 0 and "COMPLETED" in status.stdout, status.stdout + status.stderr
    assert f"({measured.launches} launch" in status.stdout, status.stdout
