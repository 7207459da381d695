"""ddpjob status / logs / cancel: fabricated run directories and sacct/squeue output. (On real jobs:
tests/cluster/test_status_real_jobs.py.)"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest

from ddp_core.cluster import slurm
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.runs import attempts, logs, status, watcher
from jobs.runs.lookup import find_runs
from tests.support.fake_slurm import FakeSlurm

NOW = time.time()


def make_run(
    path: Path,
    jobs: Sequence[str] = (),
    events: Sequence[dict[str, Any]] = (),
    metrics: Sequence[dict[str, Any]] = (),
    checkpoint_age_s: Optional[float] = None,
    log_dir: Optional[Path] = None,
) -> Path:
    (path / "checkpoints").mkdir(parents=True)
    (path / "slurm").mkdir()
    (path / "config.yaml").write_text("run:\n  name: t\n")
    entries = [{"job_id": j, "submitted": "2020-01-01T00:00:00", "via": "submitit"} for j in jobs]
    if log_dir is not None:
        entries = [e | {"via": "array", "log_dir": str(log_dir)} for e in entries]
    (path / "run.json").write_text(json.dumps({"run_id": "abc", "jobs": entries}))
    (path / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if checkpoint_age_s is not None:
        manifest = path / "checkpoints" / "step_00000010.json"
        manifest.write_text("{}")
        made = time.time() - checkpoint_age_s  # relative to now, not import time: the suite may run for minutes
        os.utime(manifest, (made, made))
    return path


def train(step: int, loss: float) -> dict[str, Any]:
    return {"step": step, "time": 0, "split": "train", "loss": loss}


def evaluation(step: int, accuracy: float, loss: float) -> dict[str, Any]:
    return {"step": step, "time": 0, "split": "eval", "accuracy": accuracy, "loss": loss}


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- status ---------------------------------------------------------------------------------------------------


def test_one_run_row(tmp_path):
    run = make_run(
        tmp_path / "run",
        jobs=["100"],
        events=[{"event": "start", "job_id": "100", "restart_count": 0, "step": 0, "world_size": 2},
                {"event": "start", "job_id": "100", "restart_count": 1, "step": 20, "world_size": 4}],
        metrics=[train(20, 1.5), train(40, 0.25), evaluation(40, 0.875, 0.3)],
        checkpoint_age_s=190,
    )  # fmt: skip
    fake = FakeSlurm(sacct="100|100|REQUEUED|0:0|t0|t1\n100|100|RUNNING|0:0|t2|Unknown\n")
    text, active = status.status_text(str(run), "eval/accuracy", runner=fake)
    header, row, code = lines_of(text)
    assert code == "code: none (each attempt imports the code as it is when it starts)"  # one run: what it imports
    head = ["JOB", "STATE", "RESTARTS", "RANKS", "STEP", "LOSS", "eval/accuracy", "CHECKPOINT", "RUN", "DIR"]
    assert header.split() == head
    # RANKS: each attempt's world size (an elastic job's second attempt got two nodes)
    assert row.split() == ["100", "REQUEUED", ">", "RUNNING", "1", "2", ">", "4", "40", "0.25", "0.875", "3m", "ago",
                           str(run)]  # fmt: skip
    assert active
    assert fake.calls == [["sacct", "-n", "-P", "-D", "-X", "-o", attempts.SACCT_FIELDS, "-j", "100"]]


def test_history_folds_repeats_and_counts_requeues(tmp_path):
    run = make_run(tmp_path / "run", jobs=["100", "200"])
    lines = ["100|100|REQUEUED|0:0|a|b"] * 3 + ["100|100|COMPLETED|0:0|a|b", "200|200|REQUEUED|0:0|a|b"]
    (row,) = status.collect([run], "eval/accuracy", runner=FakeSlurm(sacct="\n".join(lines)))
    # job 200 was just requeued: its next attempt has no sacct line yet, the restart counts already
    assert row.history(NOW) == "REQUEUED x3 > COMPLETED | REQUEUED" and row.restarts == 4 and row.active(NOW)
    (row,) = status.collect([run], "eval/accuracy", runner=FakeSlurm(sacct="200|200|CANCELLED by 0|0:15|a|b"))
    assert row.history(NOW) == "CANCELLED" and not row.active(NOW)


def test_columns_line_up(tmp_path):
    for name, acc in (("a", 0.5), ("long-trial-name", 0.75)):
        make_run(tmp_path / "sweep" / name, jobs=["7"], metrics=[train(10, 2.0), evaluation(10, acc, 1.0)])
    text, _ = status.status_text(str(tmp_path / "sweep"), "eval/accuracy", runner=FakeSlurm())
    table = lines_of(text)[:3]
    # every column starts at the same offset on every line: right-aligned numbers end there too
    assert len({line.index("RUN DIR") for line in table[:1]} | {line.index(str(tmp_path)) for line in table[1:]}) == 1
    assert len({line.index("eval/accuracy") + len("eval/accuracy") for line in table[:1]}
               | {line.index(v) + len(v) for line, v in zip(table[1:], ("0.75", "0.5"), strict=True)}) == 1  # fmt: skip


def test_sweep_sorted_by_metric_with_best_marked(tmp_path):
    sweep = tmp_path / "sweep"
    make_run(sweep / "t1", metrics=[evaluation(30, 0.5, 0.2)])
    make_run(sweep / "t2", metrics=[evaluation(30, 0.9, 0.4)])
    make_run(sweep / "t3")  # no metric yet: last
    text, _ = status.status_text(str(sweep), "eval/accuracy", runner=FakeSlurm())
    rows = lines_of(text)[1:4]
    assert [r.rsplit("/", 1)[1] for r in rows] == ["t2", "t1", "t3"]
    assert rows[0].startswith("*") and not rows[1].startswith("*") and not rows[2].startswith("*")
    assert lines_of(text)[-1] == f"* best by eval/accuracy: {sweep / 't2'} = 0.9"
    text, _ = status.status_text(str(sweep), "min:eval/loss", runner=FakeSlurm())
    rows = lines_of(text)[1:4]
    assert [r.rsplit("/", 1)[1] for r in rows] == ["t1", "t2", "t3"]
    assert rows[0].startswith("*")


def test_checkpoint_age():
    assert status.age(None, NOW) == "-"
    assert status.age(NOW - 5, NOW) == "5s ago"
    assert status.age(NOW - 125, NOW) == "2m ago"
    assert status.age(NOW - 2 * 3600 - 1, NOW) == "2h ago"
    assert status.age(NOW - 3 * 86400, NOW) == "3d ago"
    assert status.age(NOW + 10, NOW) == "0s ago"  # clock skew with the file server


def test_one_sacct_call_for_a_sweep_of_100_runs(tmp_path):
    sweep = tmp_path / "sweep"
    for i in range(100):
        # array tasks: run.json holds ARRAY_INDEX, attempts.jsonl the task's raw SLURM_JOB_ID
        started = [{"event": "start", "job_id": str(6000 + i), "restart_count": 0, "step": 0}] if i < 3 else []
        make_run(sweep / f"t{i:03d}", jobs=[f"5300_{i}"], events=started, log_dir=sweep / "slurm")
    make_run(sweep / "plain", jobs=["5400", "5401"])
    sacct_out = "\n".join(
        ["5300_0|6000|COMPLETED|0:0|a|b", "5300_1|6001|REQUEUED|0:0|a|b", "5300_1|6001|RUNNING|0:0|a|Unknown",
         "5300_2|6002|FAILED|3:0|a|b", "5300_[3-99%4]|5300|PENDING|0:0|Unknown|Unknown",
         "5400|5400|TIMEOUT|0:0|a|b", "5401|5401|COMPLETED|0:0|a|b"]
    )  # fmt: skip
    fake = FakeSlurm(sacct=sacct_out)
    rows = status.collect(find_runs(sweep), "eval/accuracy", runner=fake)
    assert fake.count("sacct") == 1 and len(fake.calls) == 1
    assert fake.calls[0][-1] == "5300,5400,5401"  # the array once, by its base id
    by_name = {r.run.name: r for r in rows}
    assert by_name["t000"].history(NOW) == "COMPLETED"
    assert by_name["t001"].history(NOW) == "REQUEUED > RUNNING" and by_name["t001"].restarts == 1
    assert by_name["t002"].history(NOW) == "FAILED(3)"
    assert all(by_name[f"t{i:03d}"].history(NOW) == "PENDING" for i in range(3, 100))
    assert by_name["t000"].job_label == "5300_0"  # the raw id in attempts.jsonl is the same job, not a second
    assert by_name["plain"].job_label == "5401 +1" and by_name["plain"].history(NOW) == "TIMEOUT | COMPLETED"
    assert by_name["plain"].restarts == 0  # a resume is a new job, not a restart
    # right after the submit, sacct may list the whole array under its bare id
    trials = [sweep / f"t{i:03d}" for i in range(3, 6)]
    rows = status.collect(trials, "eval/accuracy", runner=FakeSlurm(sacct="5300|5300|PENDING"))
    assert [r.history(NOW) for r in rows] == ["PENDING"] * 3


def test_watch_refreshes_until_every_row_ended(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path / "run", jobs=["100"])
    fake = FakeSlurm(sacct=["100|100|RUNNING|0:0|a|Unknown", "100|100|COMPLETED|0:0|a|b"])
    monkeypatch.setattr(slurm.GATEWAY, "runner", fake)
    clock = [0.0]  # the watcher's: each sleep moves it on, so its back-off (2 s first) lets it ask again
    monkeypatch.setattr(watcher.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(watcher.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    args = argparse.Namespace(path=str(run), metric="eval/accuracy", limit=20, watch=2.0)
    assert status.cmd_status(args) == 0
    assert fake.count("sacct") == 2  # one per refresh
    out = capsys.readouterr().out
    assert "RUNNING" in out and "COMPLETED" in out and "every 2 s" in out


def test_sbatch_and_local_jobs(tmp_path):
    # plain sbatch records no job in run.json: attempts.jsonl's ids count; torchrun ids never reach sacct
    sbatch_run = make_run(tmp_path / "a", events=[{"event": "start", "job_id": "777", "step": 0}])
    (sbatch_run / "slurm" / "778_batch.out").write_text("ddpjob: job 778 run directory /r\n")  # started, no event yet
    torchrun = make_run(tmp_path / "b", events=[{"event": "start", "job_id": "9f1c-uuid", "step": 0},
                                                {"event": "completed", "job_id": "9f1c-uuid", "step": 30}])  # fmt: skip
    fake = FakeSlurm(sacct="777|777|COMPLETED|0:0|a|b\n778|778|RUNNING|0:0|a|Unknown", returncode=0)
    rows = status.collect([sbatch_run, torchrun], "eval/accuracy", runner=fake)
    assert fake.calls[0][-1] == "777,778"
    assert rows[0].history(NOW) == "COMPLETED | RUNNING" and rows[0].job_label == "778 +1"
    assert rows[1].history(NOW) == "COMPLETED" and rows[1].last_step == 30  # from attempts.jsonl alone


def test_no_runs_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DdpJobError, match=r"no runs found under \./runs"):
        status.status_text(None, "eval/accuracy", runner=FakeSlurm())
    (tmp_path / "empty").mkdir()
    with pytest.raises(DdpJobError, match="not a run directory or a sweep folder") as err:
        status.status_text("empty", "eval/accuracy", runner=FakeSlurm())
    assert err.value.hint
    with pytest.raises(DdpJobError, match=r"--metric = .* has an unknown prefix"):
        status.status_text("empty", "median:eval/loss", runner=FakeSlurm())


def test_default_lists_newest_runs_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for i, name in enumerate(["old", "new", "mid"]):
        run = make_run(tmp_path / "runs" / name)
        os.utime(run / "run.json", (NOW - 100 + [0, 50, 20][i],) * 2)
    text, _ = status.status_text(None, "eval/accuracy", limit=2, runner=FakeSlurm())
    assert [line.split()[-1] for line in lines_of(text)[1:]] == ["runs/new", "runs/mid"]
    assert "*" not in text  # unrelated runs: no best


# --- logs -----------------------------------------------------------------------------------------------------

BANNER = "05:23:46 [rank {r}/2] INFO ddp_core.distributed.groups: slurm on n1: rank {r}/2 local {r}/2 node 0/1\n"


def attempt_text(rank: int, text: str) -> str:
    return "slurmstepd-n1: error: noise\n" + BANNER.format(r=rank) + text


def test_logs_across_attempts_and_jobs(tmp_path):
    run = make_run(tmp_path / "run", jobs=["100", "200"])
    slurm = run / "slurm"
    # job 100 was requeued once (submitit appends to the same file), then the run was resumed as job 200
    (slurm / "100_0_log.err").write_text(attempt_text(0, "step 10\nrequeued\n") + attempt_text(0, "step 20\n"))
    (slurm / "100_1_log.err").write_text(attempt_text(1, "rank one\n"))
    (slurm / "200_0_log.err").write_text(attempt_text(0, "finished at step 30\n"))
    out = io.StringIO()
    logs.show(RunDir(run), 0, "err", "all", out)
    text = out.getvalue()
    assert text.index("==> job 100") < text.index("step 10") < text.index("step 20") < text.index("==> job 200")
    assert text.index("==> job 200") < text.index("finished at step 30")
    assert text.count("--- attempt ") == 3 and "--- attempt 3 of 3 ---" in text
    assert "rank one" not in text

    for attempt, expected, absent in (("2", "step 20", "step 10"), ("last", "finished", "step 20")):
        out = io.StringIO()
        logs.show(RunDir(run), 0, "err", attempt, out)
        assert expected in out.getvalue() and absent not in out.getvalue()
    out = io.StringIO()
    logs.show(RunDir(run), 1, "err", "all", out)
    assert "rank one" in out.getvalue() and "step 10" not in out.getvalue()
    with pytest.raises(DdpJobError, match="has 3 attempt"):
        logs.show(RunDir(run), 0, "err", "4", io.StringIO())
    with pytest.raises(DdpJobError, match="no rank 5 err log") as err:
        logs.show(RunDir(run), 5, "err", "all", io.StringIO())
    assert "100_0_log.err" in err.value.hint


def test_split_attempts():
    assert logs.split_attempts("") == [""]
    assert logs.split_attempts("no banner\n") == ["no banner\n"]
    two = attempt_text(0, "a\n") + attempt_text(0, "b\n")
    first, second = logs.split_attempts(two)
    assert first.startswith("slurmstepd") and "a\n" in first and second.startswith(BANNER.format(r=0))
    batch = "ddpjob: job 5 run directory /r\nx\nddpjob: job 5 run directory /r\ny\n"
    assert logs.split_attempts(batch) == ["ddpjob: job 5 run directory /r\nx\n", "ddpjob: job 5 run directory /r\ny\n"]
    # A log written before the package's rename: its banner's logger was ddp_core.dist.groups.
    old = BANNER.format(r=0).replace("ddp_core.distributed.groups", "ddp_core.dist.groups")
    assert logs.split_attempts(old + "a\n" + old + "b\n") == [old + "a\n", old + "b\n"]


def test_array_task_logs_live_in_the_sweep_folder(tmp_path):
    run = make_run(tmp_path / "sweep" / "t3", jobs=["5300_3"], log_dir=tmp_path / "sweep" / "slurm")
    (tmp_path / "sweep" / "slurm").mkdir()
    (tmp_path / "sweep" / "slurm" / "5300_3_0_log.err").write_text(attempt_text(0, "trial three\n"))
    out = io.StringIO()
    logs.show(RunDir(run), 0, "err", "all", out)
    assert "==> job 5300_3" in out.getvalue() and "trial three" in out.getvalue()


def test_follow_picks_up_appends_and_a_new_job(tmp_path):
    run = make_run(tmp_path / "run", jobs=["100"])
    first = run / "slurm" / "100_0_log.err"
    first.write_text("attempt one\n")
    out = io.StringIO()
    offsets = logs.show(RunDir(run), 0, "err", "all", out)
    polls = iter([True, True, False])

    def sleep(_: float) -> None:  # between polls: the job writes on, then the run is resumed as job 200
        with open(first, "a") as f:
            f.write("more ✓\n")
        RunDir(run).record_job("200", "submitit")
        (run / "slurm" / "200_0_log.err").write_text("resumed\n")

    logs.follow(RunDir(run), 0, "err", out, lambda: next(polls), offsets, sleep=sleep)
    text = out.getvalue()
    assert text.count("attempt one") == 1 and text.count("more ✓") == 2
    assert text.index("more ✓") < text.index("==> job 200") < text.index("resumed") and text.count("resumed") == 1


# --- cancel ---------------------------------------------------------------------------------------------------


def test_cancel_one_scancel_for_all_active_jobs(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    make_run(sweep / "t3", jobs=["5300_3"], log_dir=sweep / "slurm")
    make_run(sweep / "t5", jobs=["5300_5"], log_dir=sweep / "slurm")
    make_run(sweep / "t6", jobs=["5300_6"], log_dir=sweep / "slurm")  # finished: not in the queue
    make_run(tmp_path / "plain", jobs=["80", "90"])
    # squeue lists the whole array (other sweeps' tasks too when ids are shared): only ours are cancelled
    fake = FakeSlurm(squeue="5300_3 5304\n5300_5 5306\n5300_9 5310\n90 90\n")
    cancelled = logs.cancel([str(sweep), str(tmp_path / "plain")], runner=fake)
    assert sorted(cancelled) == ["5300_3", "5300_5", "90"]
    assert fake.count("squeue") == 1 and fake.count("scancel") == 1
    assert sorted(fake.calls[-1][1:]) == ["5300_3", "5300_5", "90"]

    idle = FakeSlurm(squeue="")
    monkeypatch.setattr(slurm.GATEWAY, "runner", idle)
    assert logs.cmd_cancel(argparse.Namespace(paths=[str(sweep)])) == 0
    assert "nothing to cancel" in capsys.readouterr().out and idle.count("scancel") == 0


def test_parsers():
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    status.add_parser(subparsers)
    logs.add_parsers(subparsers)
    args = parser.parse_args(["status", "runs/x", "--watch"])
    assert (args.path, args.watch, args.metric) == ("runs/x", 10.0, None)  # None: a search's own metric
    assert parser.parse_args(["status", "--watch", "3"]).watch == 3.0
    assert parser.parse_args(["status"]).watch is None
    args = parser.parse_args(["logs", "r", "-f", "--rank", "1", "--attempt", "2"])
    assert (args.run_dir, args.follow, args.rank, args.attempt, args.stream) == ("r", True, 1, "2", "err")
    assert parser.parse_args(["cancel", "a", "b"]).paths == ["a", "b"]
    assert set(status.COMMANDS) | set(logs.COMMANDS) == {"status", "logs", "cancel"}


def test_without_accounting_states_come_from_the_controller(tmp_path):
    running = make_run(tmp_path / "running", jobs=["100"], events=[{"event": "start", "job_id": "100", "step": 0}])
    failed = make_run(tmp_path / "failed", jobs=["101"])
    forgotten = make_run(tmp_path / "forgotten", jobs=["102"], events=[{"event": "start", "job_id": "102", "step": 0}])
    done = make_run(tmp_path / "done", jobs=["103"], events=[{"event": "completed", "job_id": "103", "step": 9}])
    trials = [make_run(tmp_path / f"t{i}", jobs=[f"200_{i}"], log_dir=tmp_path / "slurm") for i in range(3)]
    calls: list[list[str]] = []
    # squeue -t all: the controller's one row per job it holds (exit_code is a wait status: 768 is exit 3)
    held = "100|100|RUNNING|1|0\n101|101|FAILED|0|768\n200_0|201|COMPLETED|0|0\n200_[1-2]|200|PENDING|0|0\n"

    def runner(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        calls.append(list(cmd))
        if cmd[0] == "sacct":
            return subprocess.CompletedProcess(list(cmd), 1, "", "sacct: error: Problem talking to the database: x\n")
        return subprocess.CompletedProcess(list(cmd), 0, held if "-O" in cmd else "", "")

    rows = status.collect([running, failed, forgotten, done, *trials], "eval/accuracy", runner=runner)
    assert [c[0] for c in calls] == ["sacct", "squeue"] and calls[1][-1] == "100,101,102,103,200"  # one call each
    assert [r.history(NOW) for r in rows] == ["RUNNING", "FAILED(3)", "UNKNOWN", "COMPLETED", "COMPLETED"] + [
        "PENDING"
    ] * 2  # fmt: skip
    assert rows[0].active(NOW) and not rows[2].active(NOW)  # a job nobody holds any more is over: --watch ends
    text, _ = status.status_text(str(forgotten), "eval/accuracy", runner=runner)
    note = text.splitlines()[-2]
    assert note.startswith("no accounting (sacct: error: Problem talking to the database: x): states come from")
    assert "each earlier attempt's state and exit code" in note and "MinJobAge" in note
    # with accounting the same rows print no such line
    ok = FakeSlurm(sacct="102|102|COMPLETED|0:0|a|b")
    assert "no accounting" not in status.status_text(str(forgotten), "eval/accuracy", runner=ok)[0]


def test_submit_wait_without_accounting_takes_the_controllers_state(monkeypatch, tmp_path, caplog):
    from jobs.runs import follow as submit

    def runner(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        if cmd[0] == "sacct":
            return subprocess.CompletedProcess(list(cmd), slurm.MISSING, "", "sacct: command not found")
        return subprocess.CompletedProcess(list(cmd), 0, "77|77|CANCELLED|0|15\n" if "-O" in cmd else "", "")

    monkeypatch.setattr(slurm.GATEWAY, "runner", runner)
    monkeypatch.setattr(submit.time, "sleep", lambda s: pytest.fail("waited for accounting that does not answer"))
    assert submit.final_state("77") == "CANCELLED"
    assert "no accounting (sacct is not installed here): job 77's final state is the controller's" in caplog.text

    class Killed:  # a job cancelled from outside leaves no result file: submitit's own wait would never end
        num_tasks = 2

        def task(self, i: int) -> Any:
            return argparse.Namespace(paths=argparse.Namespace(result_pickle=tmp_path / f"{i}_result.pkl"))

    assert not submit.results_written(Killed(), "CANCELLED")
    for i in range(2):
        (tmp_path / f"{i}_result.pkl").write_bytes(b"")
    assert submit.results_written(Killed(), "COMPLETED")
