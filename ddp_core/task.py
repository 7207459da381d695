"""``ddp_core.task``: public API, the Task API a user subclasses (``from ddp_core.task import Output, Task``;
docs/models.md, and ``task.target`` in the config reference).

This is the name users import and the one that stays: its names are re-exported from ``ddp_core.tasks.base``, which
is internal (it may move). Nothing inside ddp_core imports it (the import contracts' top layer, in
``pyproject.toml``).
"""

from ddp_core.tasks.base import Output, Task, TaskConfig, check_task, load_task
from ddp_core.tasks.flops import dense_flops_per_sample, dense_params, transformer_flops_per_sample

__all__ = [
    "Output",
    "Task",
    "TaskConfig",
    "check_task",
    "dense_flops_per_sample",
    "dense_params",
    "load_task",
    "transformer_flops_per_sample",
]
