"""``ddpjob sync``'s MLflow part, on a machine with network: a run's offline store (``RUN/mlflow/mlflow.db``, the
default when ``log.mlflow.tracking_uri`` is null) copied to a tracking server.

The copy is one MLflow run in the server's experiment of the same name, found again by its ``ddpjob.run_id`` tag:
syncing again (after more attempts ran) sends only the metric steps the server lacks. Its id is added to
``RUN/mlflow/run.json``, so a later attempt configured with that server as its ``log.mlflow.tracking_uri`` continues
the same MLflow run.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir, atomic_write_text
from ddp_core.trackers.mlflow_run import RUN_TAG, experiment_id, find_run, folder, local_store

_METRICS_PER_BATCH, _PARAMS_PER_BATCH = 1000, 100  # MLflow's limits per log_batch


def offline_store(run_dir: RunDir) -> Optional[str]:
    """The run's own MLflow store's URI, if it has one."""
    return local_store(run_dir) if (folder(run_dir) / "mlflow.db").exists() else None


def push(run_dir: RunDir, target: str) -> str:
    """Copy the run's offline MLflow run to ``target``; a one-line summary of what was sent."""
    from mlflow.tracking import MlflowClient

    source = offline_store(run_dir)
    state = folder(run_dir) / "run.json"
    known = json.loads(state.read_text()) if state.exists() else {}
    if source is None or source not in known:
        raise DdpJobError(f"no offline MLflow run in {folder(run_dir)}", "was log.mlflow.tracking_uri set for it?")
    src, dst = MlflowClient(tracking_uri=source), MlflowClient(tracking_uri=target)
    run = src.get_run(known[source])
    name = src.get_experiment(run.info.experiment_id).name
    exp = experiment_id(dst, name, None)
    tags = {k: v for k, v in run.data.tags.items() if k != "mlflow.runName"}
    copy_id = find_run(dst, exp, tags[RUN_TAG]) or str(
        dst.create_run(exp, start_time=run.info.start_time, tags=tags, run_name=run.info.run_name).info.run_id
    )
    _params(dst, copy_id, run.data.params)
    sent = sum(_metric(src, dst, run.info.run_id, copy_id, key) for key in run.data.metrics)
    if run.info.status != "RUNNING":
        dst.set_terminated(copy_id, status=run.info.status, end_time=run.info.end_time)
    atomic_write_text(state, json.dumps(known | {target: copy_id}, indent=1) + "\n")
    metrics = len(run.data.metrics)
    return f"MLflow: {sent} new values of {metrics} metrics sent to {target} (experiment {name}, run {copy_id})"


def _params(dst: Any, copy_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    have = dst.get_run(copy_id).data.params
    missing = [Param(k, v) for k, v in params.items() if k not in have]
    for i in range(0, len(missing), _PARAMS_PER_BATCH):
        dst.log_batch(copy_id, params=missing[i : i + _PARAMS_PER_BATCH])


def _metric(src: Any, dst: Any, run_id: str, copy_id: str, key: str) -> int:
    """One metric's steps the copy lacks, sent; how many."""
    have = {m.step for m in dst.get_metric_history(copy_id, key)}
    missing = [m for m in src.get_metric_history(run_id, key) if m.step not in have]
    for i in range(0, len(missing), _METRICS_PER_BATCH):
        dst.log_batch(copy_id, metrics=missing[i : i + _METRICS_PER_BATCH])
    return len(missing)
