"""Hangs and stragglers: the watchdog (ddp_core/trainer/watchdog.py) dumps, records and requeues a stalled attempt; the
rendezvous names ranks that never arrive; the straggler report (ddp_core/distributed/straggler.py) names a slow rank.

Outside Slurm a hung run ends with the watchdog's exit code (6) and its stacks; on the local cluster a hang in a
step, inside a collective, or before the first step requeues the job, which resumes bitwise exactly
(tests/cluster/test_hangs_and_stragglers.py). A main thread that holds the GIL is ended by faulthandler's C-level
backstop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.exits import ExitCode
from ddp_core.config import WatchdogConfig
from ddp_core.config.features import validate_watchdog as validate
from ddp_core.distributed.straggler import persistent
from ddp_core.errors import DdpJobError
from ddp_core.trainer.watchdog import COORDINATOR, _suspects, attempt_folder
from tests.support.hangs import HANGING, QUICK, hang_folder
from tests.support.helpers import (
    ROOT,
    events,
)
from tests.support.script_ranks import Ranks

DIGITS = str(ROOT / "configs" / "digits.yaml")


def test_ranks_started_by_hand_share_one_hang_folder_per_attempt(tmp_path):
    """No launcher's job id: every rank of an attempt names the same folder from the rendezvous port (two ranks that
    each coordinated their own recorded the hang twice), and an earlier attempt's, whose hang was claimed before this
    process started, is passed over for the next; a process alone keeps its own."""
    ranks = [DistEnv(rank=r, world_size=2, master_port=29611) for r in (0, 1)]
    assert {attempt_folder(tmp_path, env) for env in ranks} == {tmp_path / "local-29611-0"}
    earlier = tmp_path / "local-29611-0"
    earlier.mkdir()
    (earlier / COORDINATOR).touch()
    os.utime(earlier / COORDINATOR, (time.time() - 3600,) * 2)  # claimed an hour ago, by an attempt before this one
    assert {attempt_folder(tmp_path, env) for env in ranks} == {tmp_path / "local-29611-1"}
    (tmp_path / "local-29611-1").mkdir()
    (tmp_path / "local-29611-1" / COORDINATOR).touch()  # claimed now: this attempt's hang, its ranks keep it
    assert attempt_folder(tmp_path, ranks[1]) == tmp_path / "local-29611-1"
    assert attempt_folder(tmp_path, DistEnv(job_id="77", restart_count=2)) == tmp_path / "77_2"
    assert attempt_folder(tmp_path, DistEnv()) == tmp_path / f"single-{os.getpid()}"


def test_torchruns_restarted_workers_and_its_default_run_id_get_their_own_hang_folders(tmp_path):
    """torchrun's restart of its workers (TORCHELASTIC_RESTART_COUNT) is another attempt inside the Slurm job's; its
    default run id, "none", names no run (every run by hand has it): those ranks go by their port, as by hand."""
    worker = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29612"}
    in_job = worker | {"TORCHELASTIC_RUN_ID": "41", "SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"}
    assert attempt_folder(tmp_path, DistEnv.from_env(in_job)) == tmp_path / "41_1"
    again = DistEnv.from_env(in_job | {"TORCHELASTIC_RESTART_COUNT": "2"})
    assert attempt_folder(tmp_path, again) == tmp_path / "41_1.2"
    by_hand = DistEnv.from_env(worker | {"TORCHELASTIC_RUN_ID": "none"})
    assert attempt_folder(tmp_path, by_hand) == tmp_path / "local-29612-0"
    named = DistEnv.from_env(worker | {"TORCHELASTIC_RUN_ID": "exp7", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert attempt_folder(tmp_path, named) == tmp_path / "exp7_0.1"


def test_watchdog_settings_are_checked_against_the_collective_timeout():
    validate(WatchdogConfig(stall_s=0), collective_timeout_s=10)  # off
    with pytest.raises(DdpJobError, match=r"'watchdog.stall_s' = 600 is invalid: must be below dist.timeout_s"):
        validate(WatchdogConfig(stall_s=600), collective_timeout_s=600)
    with pytest.raises(DdpJobError, match=r"'watchdog.first_step_s' = 5 is invalid: must be >= watchdog.stall_s"):
        validate(WatchdogConfig(stall_s=10, first_step_s=5), collective_timeout_s=600)
    with pytest.raises(DdpJobError, match=r"'watchdog.stall_s' = nan is invalid"):
        validate(WatchdogConfig(stall_s=float("nan")), collective_timeout_s=600)


def test_suspects_are_ranks_in_their_own_code_else_the_ones_behind():
    waiting = "/x/torch/distributed/distributed_c10d.py:3000 in all_reduce"
    ranks = [{"rank": 0, "step": 3, "frame": waiting}, {"rank": 1, "step": 3, "frame": "/u/train.py:7 in load"}]
    assert [r["rank"] for r in _suspects(ranks)] == [1]
    behind = [{"rank": 0, "step": 4, "frame": waiting}, {"rank": 1, "step": 3, "frame": waiting}]
    assert [r["rank"] for r in _suspects(behind)] == [1]
    alike = [{"rank": 0, "step": 3, "frame": waiting}, {"rank": 1, "step": 3, "frame": waiting}]
    assert [r["rank"] for r in _suspects(alike)] == [0, 1]


def run_alone(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))} | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ddp_core", DIGITS, "--run-dir", str(tmp_path / "run"), *QUICK, *HANGING,
           f"task.data.once_file={tmp_path / 'once'}", "task.data.hang_rank=0", *overrides]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def test_a_hang_outside_slurm_dumps_stacks_and_exits_6(tmp_path):
    proc = run_alone(tmp_path, "watchdog.stall_s=2")
    assert proc.returncode == 6, proc.stderr[-3000:]
    folder = hang_folder(tmp_path / "run")
    stacks = (folder / "rank0.txt").read_text()
    assert "Thread MainThread" in stacks and "in _hang_here" in stacks and "time.sleep(3600)" in stacks
    assert "ddpjob-watchdog" not in stacks  # its own stack is noise
    summary = (folder / "summary.txt").read_text()
    assert summary.startswith("hang: no progress for 2 s; suspect rank 0 on ") and "in _hang_here" in summary
    (hang,) = events(tmp_path / "run", "hang")
    assert hang["step"] == 4 and hang["stacks"] == str(folder)
    assert "continue with: python -m ddp_core" in proc.stderr


def test_a_rank_stopped_in_its_first_step_is_the_hangs_suspect_within_stall_s(tmp_path):
    """Rank 1 SIGSTOPs itself in its first step, where rank 0's own allowance is watchdog.first_step_s (600 s) and
    before this only dist.timeout_s (120 s) would end rank 0's wait in the all-reduce, charged to rank 0. Its
    watchdog finds rank 1's beat older than stall_s and declares the hang, rank 1 the suspect."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddp_core", DIGITS, "--run-dir", str(run), *QUICK, *HANGING, "watchdog.stall_s=4",
           "watchdog.first_step_s=600", f"task.data.once_file={tmp_path / 'once'}", "task.data.hang_rank=1",
           "task.data.hang_at=1", "task.data.hang_in=stopped"]  # fmt: skip
    ranks = Ranks(run, 2, tmp_path / "logs", command=cmd)
    try:
        assert ranks.procs[0].wait(timeout=600) == ExitCode.HUNG, ranks.all_text()
    finally:
        ranks.procs[1].kill()  # stopped: only a SIGKILL ends it (srun's --kill-on-bad-exit, in a job)
        ranks.wait()
    # The watchdog's hang (a collective's timeout records none), after 4 s without a sign of life from rank 1.
    (hang,) = events(run, "hang")
    assert hang["rank"] == 0 and hang["step"] is None, hang
    assert "suspect rank 1 on " in hang["summary"], hang
    summary = (Path(hang["stacks"]) / "summary.txt").read_text()
    assert "\n* rank    1 on " in summary and "\n  rank    0 on " in summary, summary  # the stopped one, marked


def test_a_main_thread_holding_the_gil_is_ended_by_the_backstop(tmp_path):
    """No Python thread runs while the main thread holds the GIL in C: faulthandler's own thread dumps and exits."""
    proc = run_alone(tmp_path, "watchdog.stall_s=2", "task.data.hang_in=gil")
    assert proc.returncode == 1, proc.stderr[-3000:]
    stacks = (hang_folder(tmp_path / "run") / "rank0.txt").read_text()
    assert "most recent call first" in stacks and "in split" in stacks, stacks  # faulthandler's format


# --- stragglers (ddp_core/distributed/straggler.py) -------------------------------------------------------------------


def line(slowest: int, high: float, median: float, step_ms: float = 50.0) -> dict:
    return {"slowest_rank": slowest, "work_ms_max": high, "work_ms_median": median, "step_ms": step_ms}


def test_a_straggler_is_the_same_rank_slow_line_after_line_at_a_cost():
    assert persistent([line(1, 54, 27)] * 3, factor=1.5) == 1
    assert persistent([line(1, 54, 27)] * 2, factor=1.5) is None  # not yet line after line
    assert persistent([line(1, 54, 27), line(0, 54, 27), line(1, 54, 27)], factor=1.5) is None  # not one rank
    assert persistent([line(1, 54, 27)] * 3, factor=2.5) is None  # under the factor
    assert persistent([line(1, 3, 1)] * 3, factor=1.5) is None  # 3x, but 2 ms of a 50 ms step is noise
