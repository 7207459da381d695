"""The compute side's exit policy: how a ddpjob process ends, and with which code.

Every compute-side exit goes through ``leave`` (and, for the functions submitit calls, through ``after_submitit``):
nothing else calls ``os._exit`` or ``sys.exit``. Torch-free, so the runtime helper and the torchrun agent use it
before torch is loaded.

**Why no interpreter teardown.** A process that has run torch.distributed over gloo can abort in CPython's teardown
after a successful run (``terminate called without an active exception``, exit 134): gloo's worker threads still
hold tensors whose release needs the GIL, or a C++ thread object is destroyed while joinable. Seen in CI on the
plain DDP tutorial under torchrun (3 of 12 runs on a loaded 2-core machine) and on a submitit task of script mode.
So a process ends with ``os._exit`` once its outcome is recorded, after Python's exit handlers where they matter
(W&B's finish, a user script's own ``atexit``).
"""

from __future__ import annotations

import atexit
import enum
import functools
import logging
import os
import sys
from types import TracebackType
from typing import Any, Callable, NoReturn, Optional, TypeVar


class ExitCode(enum.IntEnum):
    """What an attempt's exit code tells Slurm (and a person reading ``sacct``)."""

    OK = 0
    REQUEUED = 0  # Slurm ends and restarts the job; the code is never seen by anyone
    FAILED = 1  # an exception on this rank (its log names the rank, host and error)
    USAGE = 2  # a config or run directory this process cannot use (the log says which and how to fix it)
    BUDGET_SPENT = 3  # a requeue budget (slurm.max_timeouts / max_preemptions / max_hangs) is spent
    STOPPED = 4  # a signal outside Slurm: checkpointed, nobody requeues; continue by starting it on the run dir
    REQUEUE_FAILED = 5  # inside Slurm, but `scontrol requeue` was refused: the job must not look COMPLETED
    HUNG = 6  # the watchdog ended a stalled attempt outside Slurm (stacks in RUN/hangs/): nobody requeues
    TERMINATED = 143  # 128 + SIGTERM, the shell convention


def leave(code: int, *, exit_handlers: bool = False) -> NoReturn:
    """End this process now with ``code``, without the interpreter's teardown (see the module docstring).
    ``exit_handlers``: run Python's ``atexit`` handlers first (a user script's, W&B's finish)."""
    if exit_handlers:
        atexit._run_exitfuncs()  # what teardown would run first; the rest of it is what aborts
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to say on it
            pass
    os._exit(int(code))


def without_result(code: int) -> NoReturn:
    """Inside a function submitit calls: end an attempt that did not finish (requeued, stopped, failed), so submitit
    writes no result for it (``ddpjob submit --wait`` keeps following a requeued job). ``after_submitit`` then ends
    the process with ``code``."""
    raise SystemExit(int(code))  # not an Exception: submitit lets it through without pickling an error


class _SubmititEnd:
    """What the function submitit called ended with; read by the exit handler registered before it ran."""

    code: Optional[int] = None
    uncaught = False


_end = _SubmititEnd()
F = TypeVar("F", bound=Callable[..., Any])


def after_submitit(fn: F) -> F:
    """Wrap a function submitit calls on a task (``ddp_core.launch.run``, ``ddp_core.script.run``) so the process
    ends through ``leave`` once submitit has written its result.

    submitit returns from the call, pickles the result (or the error), and then the interpreter exits; this adds an
    exit handler, registered before ``fn`` runs, so handlers registered while it runs (W&B's, the script's own) still
    come first, then the process leaves with the code the interpreter would have used: 0 after a result, the
    ``SystemExit`` code ``fn`` raised, 1 after an uncaught exception."""

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        atexit.register(_end_after_submitit)
        previous = sys.excepthook

        def excepthook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
            _end.uncaught = True  # submitit re-raises what fn raised, after writing the error; so does its own failure
            previous(kind, value, tb)

        sys.excepthook = excepthook
        try:
            result = fn(*args, **kwargs)
        except SystemExit as exit_:
            _end.code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            raise
        except BaseException:
            _end.code = ExitCode.FAILED
            raise
        _end.code = ExitCode.OK
        return result

    return entry  # type: ignore[return-value]


def _end_after_submitit() -> None:
    if _end.uncaught:
        leave(ExitCode.FAILED)
    if _end.code is not None:
        leave(_end.code)
