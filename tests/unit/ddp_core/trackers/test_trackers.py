"""The experiment trackers (ddp_core.trackers), each read back with its own reader: TensorBoard's EventAccumulator,
MLflow's client against a real tracking server, the csv module. Script mode's ``runtime.log`` drives them here, in
one process per attempt; the trainer's records across two interruptions of a real job: tests/cluster/test_trackers.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ddp_core.config import load_config
from ddp_core.config.tracking import check_installed
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from ddp_core.trackers import open_trackers
from ddp_core.trackers.mlflow_push import push
from ddp_core.trackers.mlflow_run import local_store
from tests.support.cli_runner import run_cli
from tests.support.script_ranks import Ranks, clean_env, make_run
from tests.support.trackers import (
    csv_steps,
    mlflow_runs,
    mlflow_server,
    mlflow_steps,
    tensorboard_hparams,
    tensorboard_steps,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


ATTEMPT = textwrap.dedent("""\
    import os, signal, sys
    from ddp_core import runtime
    first, last, end = map(int, sys.argv[1:4])
    for step in range(first, last + 1, 10):
        runtime.log({"loss": 1.0 / step, "lr": 0.1}, step=step)
        if step % 20 == 0:
            runtime.log({"accuracy": step / 100}, step=step, split="eval")
    if end == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # killed after step `last`, its checkpoint older: nothing closed
    runtime.finish("finished" if end == 2 else "stopped")
""")


def test_runtime_log_reaches_every_tracker_once_per_step_across_a_kill_and_a_stop(tmp_path, server):
    """Three attempts of a script run: the first is killed after step 30, its last checkpoint at step 10; the second
    resumes from it (steps 20 and 30 trained again) and stops after step 50 (to be requeued); the third goes on to
    60. Each tracker holds every step once, under one run: the MLflow run named after the run id, FINISHED."""
    overrides = ["log.trackers=[tensorboard,mlflow,csv]", f"log.mlflow.tracking_uri={server}"]
    run = make_run(tmp_path, tmp_path / "train.py", overrides=overrides)
    env = clean_env(DDPJOB_RUN_DIR=str(run), RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    for first, last, end in ((10, 30, 0), (20, 50, 1), (60, 60, 2)):
        proc = subprocess.run([sys.executable, "-c", ATTEMPT, str(first), str(last), str(end)], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == (-9 if end == 0 else 0), proc.stdout + proc.stderr
        assert "WARNING" not in proc.stderr, proc.stderr
    train, evals = [10, 20, 30, 40, 50, 60], [20, 40, 60]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 20, 30, 40, 40, 50, 60, 60]  # rewound to step 10 by the second
    assert set(records[0]) == {"step", "time", "split", "loss", "lr"} and records[0]["split"] == "train"
    tb = run / "tensorboard"
    assert tensorboard_steps(tb, "train/loss") == train and tensorboard_steps(tb, "eval/accuracy") == evals
    assert len(list(tb.glob("events.out.tfevents.*"))) == 3 and tensorboard_hparams(tb) == 1  # once per run
    assert (
        csv_steps(run / "metrics.csv", "train/loss") == train
        and csv_steps(run / "metrics.csv", "eval/accuracy") == evals
    )
    run_id = RunDir(run).read_meta()["run_id"]
    [mlflow_run] = mlflow_runs(server)
    assert mlflow_run.info.run_name == run_id and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.tags["ddpjob.run_id"] == run_id and mlflow_run.data.params["log.trackers"]
    assert mlflow_steps(server, mlflow_run.info.run_id, "train/loss") == train
    assert mlflow_steps(server, mlflow_run.info.run_id, "eval/accuracy") == evals


def test_a_failed_script_leaves_its_mlflow_run_failed(tmp_path, server):
    """Script mode: a script that raises after logging; the launcher closes the trackers with the failure (its exit
    skips atexit)."""
    script = tmp_path / "train.py"
    script.write_text("from ddp_core import runtime\nruntime.log({'loss': 1.0}, step=1)\nraise RuntimeError('boom')\n")
    overrides = ["log.trackers=[mlflow]", f"log.mlflow.tracking_uri={server}", "log.mlflow.experiment=failing"]
    run = make_run(tmp_path, script, overrides=overrides)
    ranks = Ranks(run, 1, tmp_path / "logs")
    assert ranks.wait() == [1], ranks.all_text()
    [failed] = mlflow_runs(server, "failing")
    assert failed.info.status == "FAILED" and failed.data.metrics == {"train/loss": 1.0}, ranks.all_text()


def test_an_offline_mlflow_store_is_pushed_by_sync_once(tmp_path, server):
    """The default store (RUN/mlflow/mlflow.db, for nodes without network), pushed to a server as `ddpjob sync
    --mlflow-uri` does: every step once, then a second push after more steps sends only the new ones."""
    cfg = load_config(None, ["run.name=r", "wandb.mode=disabled", "log.trackers=[mlflow]", "log.mlflow.experiment=x"])
    rd = RunDir(tmp_path / "run")
    rd.initialize(cfg)
    for steps, outcome in (([1, 2, 3], "stopped"), ([4, 5], "finished")):
        trackers = open_trackers(cfg, rd, skip_through=-1)
        for step in steps:
            trackers.metrics({"train/loss": 1.0 / step}, step)
        trackers.finish(outcome)
        pushed = push(rd, server)
        assert pushed.startswith(f"MLflow: {len(steps)} new values of 1 metrics sent to {server}"), pushed
    refused = run_cli("sync", str(rd.path), cwd=tmp_path, env={"MLFLOW_TRACKING_URI": ""})  # no server named
    assert refused.returncode == 2 and "has an offline MLflow store" in refused.stderr, refused.stderr
    assert "--mlflow-uri" in refused.stderr
    [copy] = mlflow_runs(server, "x")
    assert copy.info.status == "FINISHED" and copy.info.run_name == rd.read_meta()["run_id"]
    assert mlflow_steps(server, copy.info.run_id, "train/loss") == [1, 2, 3, 4, 5]
    assert copy.data.params["log.mlflow.experiment"] == "x"
    [local] = mlflow_runs(local_store(rd), "x")
    assert local.info.run_id != copy.info.run_id  # two stores, one run each
    known = json.loads((rd.path / "mlflow" / "run.json").read_text())
    assert known == {local_store(rd): local.info.run_id, server: copy.info.run_id}


def test_a_tracker_that_cannot_start_is_left_out_and_the_others_log(tmp_path, caplog):
    """An MLflow server that refuses connections: one warning, and TensorBoard and the CSV file still log (a text
    value, the straggler's host, in the CSV file only)."""
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens on loopback
    cfg = load_config(
        None, ["run.name=r", "log.trackers=[mlflow,tensorboard,csv]", f"log.mlflow.tracking_uri={closed}"]
    )
    rd = RunDir(tmp_path / "run")
    rd.initialize(cfg)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        trackers = open_trackers(cfg, rd, skip_through=-1)
    trackers.metrics({"train/loss": 0.5, "train/slowest_host": "n1"}, 5)  # type: ignore[dict-item]
    trackers.finish("finished")
    assert [t.name for t in trackers.trackers] == []  # closed
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("mlflow disabled for this attempt"), warnings
    assert tensorboard_steps(rd.path / "tensorboard", "train/loss") == [5]
    assert csv_steps(rd.path / "metrics.csv", "train/slowest_host") == [5]


def test_a_configured_tracker_that_is_not_installed_is_one_line_at_submit(monkeypatch):
    cfg = load_config(None, ["run.name=r", "log.trackers=[csv,mlflow]"])
    check_installed(cfg.log)  # installed here
    monkeypatch.setitem(sys.modules, "mlflow", None)  # Python's own way to make an import fail: as if not installed
    with pytest.raises(DdpJobError) as err:
        check_installed(cfg.log)
    assert str(err.value).startswith("config key 'log.trackers' has mlflow, but the mlflow package is not installed")
    assert "pip install 'ddpjob[trackers]'" in err.value.hint and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("log.trackers=[wandb,tb]", "'tb' is not a tracker (one of wandb, tensorboard, mlflow, csv)"),
        ("log.trackers=[csv,csv]", "names one twice"),
        ("log.mlflow.tracking_uri=localhost", "must be a URI such as http://host:5000"),
        ("log.mlflow.experiment=' '", "must not be empty"),
    ],
)
def test_log_section_errors(override, message):
    with pytest.raises(DdpJobError) as err:
        load_config(None, ["run.name=r", override])
    assert message in str(err.value) and "\n" not in str(err.value)
