"""No signal is fatal at any moment of an attempt: the warning signal at fixed offsets after the job turns RUNNING.

Slurm signals a job whenever its timer or a preemption says so, also while the ranks are still starting Python. Each
test submits one job per offset (0.05, 0.8 and 2.5 s after RUNNING) plus an uninterrupted twin, all at once,
and sends ``scancel --signal=USR2`` (what Slurm's warning does: every task of the step) at each job's offset. Every
run must end COMPLETED with its twin's weights, bitwise.

Where the signal landed is read from outside at the moment it is sent: no task yet (Slurm then signals nobody, and
the run goes on uninterrupted), a task still starting with the signal held (``SigBlk``: the window that used to kill
the ranks), or a task whose handlers are up. Wherever a task existed, the run must have been interrupted exactly
once: the held signal was handled once the handlers were up, then the job requeued and resumed. At least one signal
of each test must land in the held window, or the test did not test it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

from tests.support.cli_runner import field, run_cli
from tests.support.helpers import FINAL_DIGEST, ROOT, events, rank_logs, task_pids, wait_gone

# Before any task, while the ranks import torch (2-4 s under the suite's load), and as their handlers come up. Each
# offset is a job of 2 ranks, requeued once: more offsets inside the same import would land where these do.
OFFSETS = (0.05, 0.8, 2.5)
DIGITS = [str(ROOT / "configs" / "digits.yaml"), "train.max_steps=30", "train.eval_every=0", "train.log_every=10",
          "wandb.mode=disabled"]  # fmt: skip
CHARLM = ["--script", str(ROOT / "examples" / "charlm_script.py"), "slurm.tasks_per_node=2", "wandb.mode=disabled",
          "--", "--steps", "30", "--save-every", "1000", "--log-every", "10", "--batch", "4"]  # fmt: skip
TUTORIAL = ["--script", str(ROOT / "examples" / "ddp_tutorial.py"), "slurm.tasks_per_node=2", "--", "--steps", "5"]


def submit(cwd: Path, args: list[str]) -> tuple[str, Path]:
    """Submitted held (``sbatch --hold``): the test releases its jobs together, then watches them from the start."""
    at = args.index("--") if "--" in args else len(args)
    proc = run_cli("submit", *args[:at], "slurm.additional.hold=true", *args[at:], cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))


def release(*jobs: str) -> None:
    subprocess.run(["scontrol", "release", ",".join(jobs)], check=True, capture_output=True)


def landing(job_id: str, sig: int) -> str:
    """Where a signal sent now lands: 'none' (no task of the step has started), 'held' (a task holds it: it is still
    starting), 'handled' (every task has released it to its handler)."""
    pids = task_pids(job_id)
    if not pids:
        return "none"
    return "held" if any(_blocked(pid, sig) for pid in pids) else "handled"


def _blocked(pid: int, sig: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


def signal_after_running(offsets: dict[str, float], timeout: float = 180) -> dict[str, tuple[float, str]]:
    """``scancel --signal=USR2 JOB`` ``offsets[JOB]`` seconds after the job is first seen RUNNING (squeue, every
    10 ms); returns, per job, the offset it was sent at and where it landed (``landing``)."""
    seen: dict[str, float] = {}
    sent: dict[str, tuple[float, str]] = {}
    scan_s = 0.05  # how long the last look at the tasks took: started that much early, so the signal goes on time
    deadline = time.monotonic() + timeout
    while len(sent) < len(offsets):
        assert time.monotonic() < deadline, f"jobs not running after {timeout} s: {set(offsets) - set(seen)}"
        out = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(offsets)], capture_output=True, text=True)
        now = time.monotonic()
        for line in out.stdout.splitlines():
            job, state = line.split()
            if state == "RUNNING":
                seen.setdefault(job, now)
        for job, at in seen.items():
            if job not in sent and time.monotonic() >= at + offsets[job] - scan_s:
                # Before the signal: a task seen then still exists when it is sent (the other way is unsound).
                started = time.monotonic()
                where = landing(job, signal.SIGUSR2)
                scan_s = time.monotonic() - started
                time.sleep(max(0.0, at + offsets[job] - time.monotonic()))
                subprocess.run(["scancel", "--signal=USR2", job], check=True)
                sent[job] = (time.monotonic() - at, where)
        time.sleep(0.01)
    return sent


def final_digests(run_dir: Path, job_id: str) -> set[str]:
    logs = rank_logs(run_dir, job_id)
    out = [(run_dir / "slurm" / f"{job_id}_{rank}_log.out") for rank in logs]
    return set(FINAL_DIGEST.findall("".join([*logs.values(), *(p.read_text() for p in out if p.exists())])))


def check(runs: dict[str, Path], reference: str, sent: dict[str, tuple[float, str]]) -> None:
    report = {job: f"+{at:.2f} s: {where}" for job, (at, where) in sent.items()}
    print("signal sent:", report)  # where each landed, in the output of -s
    for job, run_dir in runs.items():
        assert wait_gone(job) == "COMPLETED", f"job {job} ({report[job]}): {rank_logs(run_dir, job)}"
        assert final_digests(run_dir, job) == {reference}, report[job]
        interrupted = len(events(run_dir, "interrupted"))
        # Sent before any task had started, the signal may have reached none (Slurm signals the step's tasks).
        assert interrupted == 1 or (interrupted == 0 and sent[job][1] == "none"), (report[job], events(run_dir))
        assert [e["event"] for e in events(run_dir)][-1] == "completed"
    assert any(where == "held" for _, where in sent.values()), f"no signal landed while a task was starting: {report}"


def run_offsets(tmp_path: Path, args: list[str]) -> tuple[dict[str, Path], str, dict[str, tuple[float, str]]]:
    """Submit the twin and one job per offset at once, signal each at its offset; returns (runs, twin digest, sent)."""
    twin_job, twin_dir = submit(tmp_path, args)
    runs = dict(submit(tmp_path, args) for _ in OFFSETS)
    release(twin_job, *runs)
    sent = signal_after_running(dict(zip(runs, OFFSETS, strict=True)))
    assert wait_gone(twin_job) == "COMPLETED"
    (reference,) = final_digests(twin_dir, twin_job)
    return runs, reference, sent


def test_trainer_survives_a_warning_at_every_moment_of_its_start(slurm_cluster, tmp_path):
    runs, reference, sent = run_offsets(tmp_path, DIGITS)
    check(runs, reference, sent)


def test_scripts_survive_a_warning_at_every_moment_of_their_start(slurm_cluster, tmp_path):
    """examples/charlm_script.py (ddp_core.runtime) at every offset; and a plain script (the DDP tutorial, no ddpjob
    import), signalled while it starts, runs to its end: the warning stays held, as no handler takes it."""
    plain_job, plain_dir = submit(tmp_path, TUTORIAL)
    release(plain_job)
    (plain,) = signal_after_running({plain_job: 0.8}).values()
    runs, reference, sent = run_offsets(tmp_path, CHARLM)
    check(runs, reference, sent)
    for job, (_, where) in sent.items():
        if where != "none":
            assert re.search(r"rank 0: resumed from step_\d+\.pt \(restart 1\)", "".join(
                (runs[job] / "slurm" / f"{job}_0_log.out").read_text())), job  # fmt: skip
    assert wait_gone(plain_job) == "COMPLETED", plain
    assert [e["event"] for e in events(plain_dir)] == ["start", "completed"], plain
