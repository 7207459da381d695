"""script: script mode, where the job runs a user's own training script instead of the built-in trainer.

Owns running a script as each rank (``mode``: ``run``, what submitit calls on every task, and ``main``, behind
``python -m ddp_core.script RUN``), the torchrun agent that starts a node's ranks when ``script.launcher`` is
torchrun (``torchrun``) and the helper users' scripts import (``runtime``, also as ``ddp_core.runtime``): the
warning signal, the run directory, requeue. ``run`` and ``main`` are exposed here: submitit pickles
``ddp_core.script.run`` by reference.
"""

from ddp_core.script.mode import main, run

__all__ = ["main", "run"]
