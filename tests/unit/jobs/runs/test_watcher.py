"""The login node's watcher (jobs/runs/watcher.py) and --wait's live line (jobs/runs/follow.py,
jobs/runs/throughput.py): when Slurm is asked, a rate limit kept as "later", the line from a real run's files."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path
from typing import Sequence

import pytest

from ddp_core.cluster import slurm
from ddp_core.cluster.backoff import Backoff
from ddp_core.run.rundir import RunDir
from jobs.runs import follow, throughput, watcher
from tests.support.digits import trainer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_poll_asks_on_the_back_off_and_keeps_its_answer_through_a_rate_limit():
    clock, asked = Clock(), []

    def fetch() -> str:
        asked.append(clock.now)
        if clock.now == 6:
            raise slurm.SlurmBusy("squeue: the Slurm controller rate-limits your calls", "later")
        return f"answer at {clock.now:g}"

    poll: watcher.Poll[str] = watcher.Poll(Backoff(), clock)
    seen = []
    for t in range(0, 70):  # a refresh every second, for 70 s
        clock.now = float(t)
        seen.append(poll.ask("job", fetch))
    assert asked == [0, 2, 6, 36, 66]  # 2, 4, then refused at 6: the longest delay (30 s)
    assert seen[6] == "answer at 2" and seen[35] == "answer at 2" and seen[36] == "answer at 36"
    poll.hurry(after_s=2)  # the files said the attempt ended: ask soon
    clock.now = 71.0
    poll.ask("job", fetch)
    assert asked[-1] == 71 and poll.queries == 6


def test_the_live_line_from_a_real_run(tmp_path: Path):
    run = tmp_path / "run"
    trainer(run, "train.max_steps=40", "train.log_every=10", "train.eval_every=0", "checkpoint.every_steps=0")
    rd = RunDir(run)
    events, metrics = rd.events(), rd.metrics()
    job = str(next(e for e in events if e["event"] == "start").get("job_id"))
    pending = slurm.QueuedJob(job, job, "PENDING", 0, "0:0", "Priority", "2026-12-02T10:00:00")
    assert throughput.live_line(job, pending, [], [], 40) == (
        f"job {job} PENDING (Priority), start estimate 2026-12-02T10:00:00"
    )
    assert "no start estimate yet" in throughput.live_line(
        job, slurm.QueuedJob(job, job, "PENDING", 0, "0:0"), [], [], 40
    )
    running = slurm.QueuedJob(job, job, "RUNNING", 0, "0:0", "None")
    mid = [r for r in metrics if r["split"] == "train" and r["step"] <= 20]
    last = mid[-1]
    line = throughput.live_line(job, running, events, mid, throughput.max_steps_in(rd))
    eta = throughput.eta_of(last, 40)
    assert line == (f"job {job} RUNNING, step 20/40, {1000 / last['step_ms']:.3g} steps/s, loss {last['loss']:.4g}, "
                    f"ETA {eta}, restarts 0")  # fmt: skip
    # The files say it started before Slurm was asked again: RUNNING, not the PENDING of the last answer.
    assert throughput.live_line(job, pending, events, mid, 40).startswith(f"job {job} RUNNING, step 20/40")
    assert throughput.live_line(job, running, events, [], 40) == f"job {job} RUNNING, no step yet"


def test_follow_asks_one_squeue_per_poll_and_prints_plain_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    run = tmp_path / "run"
    trainer(run, "train.max_steps=40", "train.log_every=20", "train.eval_every=0", "checkpoint.every_steps=0")
    answers = iter(["9|9|PENDING|0|0|Resources|N/A", "9|9|RUNNING|0|0|None|2026-12-02T10:00:00"] * 1 + [""] * 9)
    calls: list[list[str]] = []

    def runner(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        calls.append(list(cmd))
        return subprocess.CompletedProcess(list(cmd), 0, next(answers) + "\n", "")

    clock = Clock()
    monkeypatch.setattr(watcher.time, "sleep", lambda s: setattr(clock, "now", clock.now + s))
    out = io.StringIO()
    monkeypatch.setattr(watcher.sys, "stdout", out)
    follower = follow.Follow("9", RunDir(run), slurm.SlurmGateway(runner))
    line = watcher.Line(tty=False, clock=clock)
    assert watcher.watch(follower, 1.0, line=line, poll=watcher.Poll(Backoff(), clock)) == 0
    assert [c[0] for c in calls] == ["squeue"] * 3  # at 0, 2 and 6 s: then the job left the queue
    assert out.getvalue().splitlines()[0] == "job 9 PENDING (Resources), no start estimate yet"
    assert out.getvalue().splitlines()[1].startswith("job 9 RUNNING, step 40/40, ")
