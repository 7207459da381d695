"""Kept for sweeps submitted before ``ddp_core.search.worker``: submitit pickled ``ddp_core.search_worker.run``
by reference, and a requeued array task unpickles it by that name."""

from ddp_core.search.worker import run

__all__ = ["run"]
