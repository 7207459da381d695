"""The MLflow tracker (log.trackers: mlflow): one MLflow run per ddpjob run, named after its run id, in
``log.mlflow.tracking_uri`` (a tracking server, or a store), by default a SQLite store inside the run directory
(``RUN/mlflow/mlflow.db``) for compute nodes without network, which ``ddpjob sync`` uploads (``mlflow_push``).

Every attempt continues the same MLflow run: its id is kept in ``RUN/mlflow/run.json`` per tracking URI, and a run
whose id was lost is found again by its ``ddpjob.run_id`` tag. The run is RUNNING while an attempt trains, then
FINISHED, KILLED (stopped, to be continued) or FAILED. Metrics are sent synchronously (one batch per call), with
fewer and shorter retries than MLflow's defaults (7 retries, 120 s timeout): a dead server costs a training run a
minute, not a quarter of an hour, and then the fan-out drops MLflow for the attempt.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from ddp_core.config import Config
from ddp_core.run.rundir import RunDir, atomic_write_text
from ddp_core.trackers.base import Outcome, numbers, scalar_params

RUN_TAG = "ddpjob.run_id"  # the ddpjob run id, on the MLflow run
STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
_PARAMS_PER_BATCH, _PARAM_CHARS = 100, 6000  # MLflow's limits: params per log_batch, characters of a value


def folder(run_dir: RunDir) -> Path:
    return run_dir.path / "mlflow"


def local_store(run_dir: RunDir) -> str:
    """The run directory's own store: the tracking URI when log.mlflow.tracking_uri is null."""
    return f"sqlite:///{folder(run_dir) / 'mlflow.db'}"


def tracking_uri(cfg: Config, run_dir: RunDir) -> str:
    return cfg.log.mlflow.tracking_uri or local_store(run_dir)


def open_tracker(cfg: Config, run_dir: RunDir, run_id: str) -> MlflowRun:
    for var, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3"), ("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")):
        os.environ.setdefault(var, value)  # the user's own settings win
    return MlflowRun(tracking_uri(cfg, run_dir), cfg.log.mlflow.experiment, run_dir, run_id)


def experiment_id(client: Any, name: str, artifacts: Optional[Path]) -> str:
    """The experiment's id, created if missing (a sweep's trials may race to create it: the loser finds it)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name, artifact_location=artifacts.as_uri() if artifacts else None))
    except Exception:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def find_run(client: Any, experiment: str, run_id: str) -> Optional[str]:
    """The MLflow run tagged with this ddpjob run id, if there is one."""
    runs = client.search_runs([experiment], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1)
    return str(runs[0].info.run_id) if runs else None


class MlflowRun:
    """This attempt's hold on the run's MLflow run."""

    name = "MLflow"

    def __init__(self, uri: str, experiment: str, run_dir: RunDir, run_id: str) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.Param = Metric, Param
        self.state = folder(run_dir) / "run.json"
        self.state.parent.mkdir(exist_ok=True)
        self.client = client = MlflowClient(tracking_uri=uri)
        known = json.loads(self.state.read_text()) if self.state.exists() else {}
        artifacts = folder(run_dir) / "artifacts" if uri == local_store(run_dir) else None
        exp = experiment_id(client, experiment, artifacts)
        found = known.get(uri) or find_run(client, exp, run_id)
        self.new = found is None
        if found is None:
            tags = {RUN_TAG: run_id, "ddpjob.run_dir": str(run_dir.path)}
            found = str(client.create_run(exp, run_name=run_id, tags=tags).info.run_id)
            atomic_write_text(self.state, json.dumps(known | {uri: found}, indent=1) + "\n")
        else:
            client.update_run(found, status="RUNNING")
        self.id: str = found

    def params(self, values: dict[str, Any]) -> None:
        if not self.new:
            return  # MLflow refuses a param logged again with another value (a change on ddpjob resume)
        params = [self.Param(k, str(v)[:_PARAM_CHARS]) for k, v in scalar_params(values).items()]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self.client.log_batch(self.id, params=params[i : i + _PARAMS_PER_BATCH])

    def metrics(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[self.Metric(k, v, now, step) for k, v in numbers(values).items()])

    def finish(self, outcome: Outcome) -> None:
        self.client.set_terminated(self.id, status=STATUS[outcome])
