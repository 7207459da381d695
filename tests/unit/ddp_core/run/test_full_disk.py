"""A full filesystem under the run (a real tmpfs, filled up): the trainer trains on through checkpoints it cannot
write, warns naming the mount point and records each refusal where ``ddpjob status`` reads it, and after
``MAX_FAILED_SAVES`` in a row stops with a failure the table calls the filesystem's (requeued, no node excluded); a
metrics line or an event a full disk refuses is lost, never the run."""

import json
import os
import subprocess
import sys

from ddp_core.cluster import failures
from ddp_core.run import diskfull
from ddp_core.run.reporting import MetricsLog
from ddp_core.run.rundir import RunDir
from jobs.runs import notes
from tests.support.digits import DIGITS
from tests.support.filesystems import fill, small_tmpfs
from tests.support.helpers import ROOT


def test_checkpoints_on_a_full_filesystem_train_on_then_stop_as_a_storage_failure(tmp_path):
    with small_tmpfs(tmp_path / "shared", 1 << 20) as shared:
        fill(shared)  # not a byte left where the checkpoints go
        run = tmp_path / "run"
        overrides = ["train.max_steps=40", "checkpoint.every_steps=4", "train.eval_every=0", f"checkpoint.dir={shared}"]
        cmd = [sys.executable, "-m", "ddp_core", DIGITS, "--run-dir", str(run), *overrides]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    events = RunDir(run).events()
    failed = [e for e in events if e["event"] == "save_failed"]
    # Steps 4 and 8 failed and training went on; the third in a row (step 12) ended the attempt.
    assert [(e["step"], e["count"]) for e in failed] == [(4, 1), (8, 2), (12, 3)], failed
    assert all(e["error"] == f"no space left on {shared}" for e in failed)
    assert f"the checkpoint of step 4 was not saved: no space left on {shared}; training goes on" in proc.stderr
    (rank,) = [e for e in events if e["event"] == "rank_failed"]
    assert rank["kind"] == "storage" and rank["step"] == 12 and "3 checkpoints in a row" in rank["error"]
    lines = notes.for_run("run", events, None)
    assert any(line.startswith(f"checkpoint not saved in run at step 12: no space left on {shared}") for line in lines)


def test_the_failure_table_calls_a_full_filesystem_the_filesystems(tmp_path):
    assert failures.classify(diskfull.StorageFailing("3 checkpoints in a row")) is failures.Kind.storage
    assert failures.classify(OSError(28, "No space left on device")) is failures.Kind.storage
    assert failures.classify(OSError(122, "Disk quota exceeded")) is failures.Kind.storage
    wrapped = RuntimeError("unexpected pos")  # torch.save's error, raised from the file's
    wrapped.__context__ = OSError(28, "No space left on device")
    assert diskfull.disk_error(wrapped).errno == 28 and diskfull.disk_error(RuntimeError("x")) is None
    assert failures.to_exclude([], failures.Failure(failures.Kind.storage, 0, "n1", 12, "full")) == {}


def test_a_full_disk_loses_metrics_lines_and_events_never_the_run(tmp_path, caplog):
    with small_tmpfs(tmp_path / "fs", 1 << 20) as folder:
        run = RunDir(folder)
        filler = fill(folder)  # before the files exist: their first line needs a page the filesystem lacks
        metrics = MetricsLog(run.metrics_file, 0)
        metrics.write(2, "train", {"loss": 2.0})  # lost, with a warning: no exception
        metrics.sync()
        run.log_event("requeued", step=2)
        assert f"metrics line of step 2 not written to {run.metrics_file}: no space left on {folder}" in caplog.text
        assert "event 'requeued' not written" in caplog.text
        filler.unlink()  # space again: the next lines are whole, on lines of their own
        metrics.write(3, "train", {"loss": 3.0})
        metrics.close()
        run.log_event("completed", step=3)
        assert [r["step"] for r in run.metrics()] == [3]
        assert [e["event"] for e in run.events()] == ["completed"]
        assert all(json.loads(line) for line in run.metrics_file.read_text().split("\n") if line)
