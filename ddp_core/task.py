"""``ddp_core.task``: the public name of the Task API a user subclasses (``ddp_core.tasks.base``)."""

from ddp_core.tasks.base import Output, Task, TaskConfig, check_task, load_task

__all__ = ["Output", "Task", "TaskConfig", "check_task", "load_task"]
