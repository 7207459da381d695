"""The optional helper for training scripts run by ddpjob (script mode): stop cleanly, requeue, log, checkpoint.

A plain torchrun script runs unchanged under ddpjob (``python -m ddp_core.script RUN``). A script that should survive
preemption and time limits imports this module and does three things itself::

    from ddp_core import runtime          # installs the signal handlers: import it at the top of the script

    start = resume_from(runtime.checkpoint_dir())          # your code: the newest checkpoint, if any
    for step in range(start, max_steps):
        ...                                                # one optimizer step
        runtime.log({"loss": loss}, step=step + 1)         # metrics.jsonl + the trackers, rank 0
        if runtime.stop_requested():                       # the same answer on every rank, after the same step
            save(runtime.checkpoint_dir(), step + 1)       # your code, collective as you need it
            runtime.requeue(step=step + 1)                 # never returns

API (importing this module never loads torch, nor do its calls except ``requeue``, through the exit policy):

- ``stop_requested() -> bool``: True on every rank, from the same call on, once any rank received the warning signal
  (``slurm.signal``, USR2 by default; ``DDPJOB_SIGNAL`` names it) or SIGTERM. One collective per call: a MAX
  all-reduce of one int64 over the default process group when one is initialised (a CPU tensor; with an NCCL-only
  group, one on the current CUDA device: call ``torch.cuda.set_device`` first, as NCCL itself needs); without a
  group, this process's own flag. Call it at step boundaries, on every rank, the same number of times.
- ``requeue(step=None) -> NoReturn``: after your checkpoint. Rank 0 records the interruption in ``attempts.jsonl`` and
  asks Slurm to requeue the job: the trainer's own decision (``cluster.exits.after_stop``): the same requeue budgets
  (``slurm.max_timeouts``, ``slurm.max_preemptions``), events and exit codes. Every rank then meets at a barrier (no
  rank leaves before rank 0 has requeued: ``srun --kill-on-bad-exit`` would end it) and exits. Outside Slurm it exits
  with 4 (``ExitCode.STOPPED``), logging how to continue. ``step``: the step your checkpoint holds, for the records;
  default the last step given to ``log``. Called without a signal (the script's own choice), it counts as the
  warning signal.
- ``checkpoint_dir() -> Path`` (``RUN/checkpoints``, ``DDPJOB_CHECKPOINT_DIR``), ``run_dir() -> Path``
  (``DDPJOB_RUN_DIR``), ``restart_count() -> int`` (``DDPJOB_RESTART_COUNT``, else ``SLURM_RESTART_COUNT``, else 0),
  ``in_ddpjob() -> bool``.
- ``log(metrics, step, split="train")``: rank 0 appends ``{"step", "time", "split", **metrics}`` to
  ``RUN/metrics.jsonl`` (the trainer's ``MetricsLog`` records) and logs ``split/key`` to the configured trackers
  (``log.trackers``: W&B, TensorBoard, MLflow, CSV) under the run's fixed id (``run.json``), as the trainer does: the
  first call of an attempt rewinds ``metrics.jsonl`` to before its step, and steps an earlier attempt already sent
  to the trackers are not sent again. Other ranks: nothing.
- ``finish()``: flush metrics and close the trackers' runs (the launcher calls it after the script; also at exit).

Outside ddpjob (no ``DDPJOB_RUN_DIR``: the script started by torchrun or python directly) ``stop_requested`` and
``restart_count`` work as above; ``log`` degrades to a log line on rank 0 (metrics are a side effect: a debugging run
should not crash on them); ``checkpoint_dir`` and ``run_dir`` raise ``DdpJobError``: inventing a directory would
put checkpoints where nobody looks and silently resume from them later. Branch on ``in_ddpjob()`` to choose your
own. ``requeue`` exits with 4 (nothing requeues a script that ddpjob did not start).

Importing this module replaces the warning signal's and SIGTERM's handlers with ones that only record the signal
(``preemption.StopFlag``): a script that imports it must poll ``stop_requested()``, or SIGTERM no longer ends it.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Optional

from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.exits import ExitCode, after_stop, leave
from ddp_core.cluster.preemption import StopFlag
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir

if TYPE_CHECKING:
    from ddp_core.config import Config
    from ddp_core.run.reporting import MetricsLog
    from ddp_core.trackers import Outcome, Trackers

__all__ = [
    "checkpoint_dir",
    "finish",
    "in_ddpjob",
    "log",
    "requeue",
    "restart_count",
    "run_dir",
    "stop_requested",
]

# The environment the launcher (ddp_core.script) gives the script.
RUN_DIR_VAR = "DDPJOB_RUN_DIR"
CHECKPOINT_DIR_VAR = "DDPJOB_CHECKPOINT_DIR"
RESTART_COUNT_VAR = "DDPJOB_RESTART_COUNT"
SIGNAL_VAR = "DDPJOB_SIGNAL"  # the run's slurm.signal (USR1 or USR2)

_log = logging.getLogger(__name__)
_NOT_UNDER_DDPJOB = (
    "start it with `python -m ddp_core.script RUN_DIR` (what `ddpjob submit --script` runs), or set "
    f"{RUN_DIR_VAR} to a run directory; `runtime.in_ddpjob()` tells a script which case it is in"
)


@dataclass
class _State:
    """This process's runtime state: one per process, built lazily (except the signal flag, built at import)."""

    flag: Optional[StopFlag] = None
    agreed: int = 0  # the largest signal number the ranks agreed on (SIGTERM over the warning signal)
    last_step: Optional[int] = None  # the last step given to log(), on every rank
    env: Optional[DistEnv] = None
    config: Optional[Config] = None
    metrics: Optional[MetricsLog] = None
    trackers: Optional[Trackers] = None
    warned_outside: bool = False


_state = _State()


def _warning_signal() -> str:
    name = os.environ.get(SIGNAL_VAR) or "USR2"
    if name.upper().removeprefix("SIG") not in ("USR1", "USR2"):
        raise DdpJobError(f"{SIGNAL_VAR}={name!r} is not a warning signal", "use USR1 or USR2 (slurm.signal)")
    return name


def _flag() -> StopFlag:
    if _state.flag is None:
        _state.flag = StopFlag(_warning_signal())
    return _state.flag


def _env() -> DistEnv:
    # The launcher exported torchrun's variables: every rank reads the same identity the launcher built.
    if _state.env is None:
        _state.env = DistEnv.from_env()
    return _state.env


def in_ddpjob() -> bool:
    """True when this process runs a ddpjob run (``DDPJOB_RUN_DIR`` is set)."""
    return bool(os.environ.get(RUN_DIR_VAR))


def run_dir() -> Path:
    """The run directory (``DDPJOB_RUN_DIR``); ``DdpJobError`` outside ddpjob."""
    raw = os.environ.get(RUN_DIR_VAR)
    if not raw:
        raise DdpJobError(f"this script is not running under ddpjob ({RUN_DIR_VAR} is not set)", _NOT_UNDER_DDPJOB)
    return Path(raw)


def checkpoint_dir() -> Path:
    """Where the script keeps its checkpoints: ``RUN/checkpoints`` (``DDPJOB_CHECKPOINT_DIR``), created if missing;
    ``DdpJobError`` outside ddpjob."""
    raw = os.environ.get(CHECKPOINT_DIR_VAR)
    path = Path(raw) if raw else RunDir(run_dir()).checkpoints
    path.mkdir(parents=True, exist_ok=True)
    return path


def restart_count() -> int:
    """How many times Slurm restarted this job (0 for its first attempt, and outside Slurm)."""
    raw = os.environ.get(RESTART_COUNT_VAR)
    if raw:
        try:
            return int(raw)
        except ValueError:
            raise DdpJobError(f"{RESTART_COUNT_VAR}={raw!r} is not an integer") from None
    return _env().restart_count


def stop_requested() -> bool:
    """True on every rank once any rank received the warning signal or SIGTERM: the same answer on every rank for
    the same call (one small all-reduce when a process group is initialised). Call it on every rank alike."""
    agreed = _all_ranks_max(int(_flag().received))
    _state.agreed = max(_state.agreed, agreed)
    return bool(_state.agreed)


def _all_ranks_max(value: int) -> int:
    # A script that never imported torch.distributed has no process group: no need to import torch to learn that.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return value
    import torch

    # An NCCL-only group serves CUDA tensors only; every other backend here (gloo, cpu:gloo,cuda:nccl, mpi) serves
    # CPU tensors, which keeps the flag off the CUDA stream.
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    # Signal numbers: USR1 10 < USR2 12 < TERM 15 on Linux, so MAX makes SIGTERM win if any rank saw it.
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def log(metrics: dict[str, float], step: int, split: str = "train") -> None:
    """Rank 0: one ``metrics.jsonl`` record and one log to each tracker at ``step``; other ranks: nothing. Outside
    ddpjob, rank 0 logs a line instead."""
    _state.last_step = step
    env = _env()
    if not env.is_main:
        return
    values = {k: float(v) for k, v in metrics.items()}  # tensors and numpy scalars become plain JSON numbers
    if not in_ddpjob():
        if not _state.warned_outside:
            _log.info("not running under ddpjob (%s is not set): metrics go to this log only", RUN_DIR_VAR)
            _state.warned_outside = True
        _log.info("step %d %s %s", step, split, " ".join(f"{k} {v:.6g}" for k, v in values.items()))
        return
    if _state.metrics is None:
        _open_logs(step)
    assert _state.metrics is not None and _state.trackers is not None
    _state.metrics.write(step, split, values)
    _state.trackers.metrics({f"{split}/{k}": v for k, v in values.items()}, step)


def _open_logs(first_step: int) -> None:
    """The first ``log`` of this attempt: lines past ``first_step - 1`` came from an attempt that died after its last
    checkpoint and are dropped (the file never repeats a step); the trackers skip steps an earlier attempt already
    sent."""
    from ddp_core.run.reporting import MetricsLog
    from ddp_core.trackers import open_trackers

    rd = RunDir(run_dir())
    _state.metrics = MetricsLog(rd.metrics_file, first_step - 1)
    _state.trackers = open_trackers(_config(), rd, _state.metrics.previous_last_step)
    atexit.register(finish)  # a script started without the launcher still closes its trackers' runs


def _config() -> Config:
    if _state.config is None:
        _state.config = RunDir(run_dir()).load_config()
    return _state.config


def last_step() -> Optional[int]:
    """The last step the script gave ``log`` (None if none): what the launcher records when the script returns."""
    return _state.last_step


def finish(outcome: Outcome = "finished") -> None:
    """Make the metrics written so far durable and close the trackers' runs (idempotent). ``outcome``: how this
    attempt ended, for the trackers (``requeue`` passes "stopped")."""
    if _state.metrics is not None:
        _state.metrics.close()  # a later ``log`` opens it again
    if _state.trackers is not None:
        _state.trackers.finish(outcome)


def requeue(step: Optional[int] = None) -> NoReturn:
    """After the script's checkpoint, on every rank: rank 0 records the interruption and requeues the job (within the
    run's budgets), every rank exits with the trainer's code for it. Never returns."""
    env = _env()
    flag = _flag()
    step = _state.last_step if step is None else step
    # Without an agreed signal the script chose to stop itself: treat it as a warning (a requeue, not a kill).
    signum = _state.agreed or int(flag.received) or int(flag.warning)
    try:
        # The trackers first, as the trainer does: once rank 0 has requeued, Slurm ends the step (SIGKILL after
        # KillWait).
        finish("stopped")
        if in_ddpjob():
            rd = RunDir(run_dir())
            rerun = f"python -m ddp_core.script {rd.path}"
            code = after_stop(_config(), rd, env, signum, step, rerun, flag.received_at)
        else:
            code = ExitCode.STOPPED
            if env.is_main:
                _log.warning(
                    "stopped at step %s outside ddpjob (%s is not set): nothing requeues this script; run "
                    "it again to continue from its checkpoint",
                    step,
                    RUN_DIR_VAR,
                )
        _teardown()  # its barrier keeps every rank alive until rank 0 has requeued
    except BaseException as err:
        _log.error(
            "rank %d/%d on %s failed in runtime.requeue(): %s: %s",
            env.rank,
            env.world_size,
            socket.gethostname(),
            type(err).__name__,
            err,
            exc_info=True,
        )
        code = ExitCode.FAILED
    leave(code)  # no interpreter teardown: the script's own code after this must not run, nor exit 0


def _teardown() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# Handlers from the first moment the script can be signalled on purpose: a warning that arrived before its first
# stop_requested() is kept, not lost. (From a thread other than the main one Python refuses; the first call installs.)
try:
    _flag()
except ValueError:
    pass
