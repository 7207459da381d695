"""trackers: the experiment trackers rank 0 drives (``log.trackers``): W&B, TensorBoard, MLflow and a CSV file.
Torch-free: script mode's ``runtime.log`` reaches them without importing torch.

- ``base``: the ``Tracker`` interface (the hyperparameters once, the metrics by step, ``finish`` with the attempt's
  outcome) that each backend implements.
- ``fanout``: ``Trackers``, every configured tracker from one call, the steps an earlier attempt already sent
  skipped in one place; ``open_trackers`` at an attempt's start. What ``Records`` and ``runtime.log`` call.
- One module per backend, each importing its library only when configured: ``wandb_run``, ``tensorboard_events``,
  ``mlflow_run`` (and ``mlflow_push``, which ``ddpjob sync`` runs on the login node), ``csv_file``.
"""

from ddp_core.trackers.base import Outcome, Tracker
from ddp_core.trackers.fanout import Trackers, open_trackers

__all__ = ["Outcome", "Tracker", "Trackers", "open_trackers"]
