"""The experiment trackers' own records, read back with each tracker's own reader, and a real MLflow tracking server
(SQLite backend, loopback) for the tests that log to one: ``mlflow_server``, which a module's fixture enters."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ddp_core.cluster.rendezvous import free_port
from tests.support.helpers import stop_server, wait_for


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """``mlflow server`` on a free loopback port with a SQLite store in ``folder``; its URL. Stopped on exit."""
    port = free_port()  # the server binds it a moment later
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
           "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]  # fmt: skip
    with open(folder / "server.log", "w") as out:
        # Without its job runner (a second process polling for GenAI jobs): the tests log runs only.
        env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=folder, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(url) or proc.poll() is not None, 90, "the MLflow server")
        assert proc.poll() is None, (folder / "server.log").read_text()[-3000:]
        yield url
    finally:
        stop_server(proc, timeout_s=20)


def tensorboard_steps(folder: Path, tag: str) -> list[int]:
    """The steps of one scalar in a TensorBoard log folder (every event file), with TensorBoard's own reader (all
    points kept: no sampling)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    acc.Reload()
    return [event.step for event in acc.Scalars(tag)]


def tensorboard_hparams(folder: Path) -> int:
    """How many hyperparameter records (HParams' session start) the folder's event files hold."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={TENSORS: 0})
    acc.Reload()
    return (
        len(acc.Tensors("_hparams_/session_start_info"))
        if "_hparams_/session_start_info" in acc.Tags()["tensors"]
        else 0
    )


def mlflow_runs(uri: str, experiment: str = "ddpjob") -> list[Any]:
    """Every MLflow run of an experiment, through MLflow's client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else list(client.search_runs([exp.experiment_id]))


def mlflow_steps(uri: str, run_id: str, key: str) -> list[int]:
    """One metric's steps in an MLflow run, in step order (every value logged, repeats included)."""
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def csv_steps(path: Path, column: str) -> list[int]:
    """The steps of the rows of ``metrics.csv`` that have ``column``, read with the csv module."""
    with open(path, newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get(column)]
