"""Script mode's warning signal: the handler a script or its framework installs runs at an optimizer step that every
rank agrees on, never wherever the signal happens to find each rank.

**Why.** Python runs a signal's handler in the main thread, between two bytecodes. Slurm signals every rank at about
the same moment, but a rank inside a C++ call runs nothing until that call returns. Under DDP one rank is often
waiting inside ``backward`` for its peer's gradient all-reduce while the peer is still in Python (its forward, its
data loader, a ``sleep``): the peer runs the handler at once, the waiting rank only after that all-reduce. Lightning's
auto-requeue handler saves a checkpoint, whose barrier then waits for a rank that waits for the all-reduce: both hang
until the time limit (seen with a plain Lightning script under ddpjob; py-spy stacks: one rank in
``_slurm_sigusr_handler_fn`` → ``save_checkpoint`` → ``barrier``, the other in ``_engine_run_backward``). Lightning's
own issue 21406 describes the same race.

**How.** ``intercept`` puts itself in front of ``signal.signal`` and ``signal.getsignal`` for the warning signal
(``slurm.signal``) for the rest of the process:

- a callable handler of the script's is kept, not installed: ``getsignal`` reports it (Lightning's
  ``_has_already_handler`` and its teardown see what they set), and ddpjob's recorder is installed instead, so the
  signal is unblocked (``ddp_core.cluster.signals``: it was held since the task started) and ``SigCgt`` shows a
  handler (the torchrun agent passes the warning on to workers that handle it);
- the recorder only records (``preemption.StopFlag.record``). A global optimizer pre-step hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``) exchanges the flag between ranks at step boundaries,
  as the trainer does (``StopFlag.agree``: asynchronous, every k steps, about 100 ms apart, on gloo:
  the default group when it serves CPU tensors, else a gloo group of its own), and every rank calls the script's
  handler in the same optimizer step, before that step's closure (Lightning's step: the previous step complete, its
  counters consistent), with the signal's number and the caller's frame;
- in a process without a process group of more than one rank, nothing can disagree: the handler runs from the
  recorder at once, as it would without ddpjob;
- ``SIG_IGN`` is installed for real. ``SIG_DFL`` (a framework's teardown) keeps the warning held if it never had a
  handler, and otherwise leaves ddpjob's recorder in place: threads started since inherited the released signal, and
  the default action would end the process through them. What it records goes to the next handler the script
  installs.

**A stall after the warning.** Once a rank has recorded the warning, a watchdog (``ddp_core.trainer.watchdog``) runs
on it, beaten by optimizer steps. No step for ``min(watchdog.stall_s, slurm.signal_lead_s / 2)`` (a handler that
hangs, a save stuck on one rank, a script whose ranks stop making progress): every armed rank dumps its stacks to
``RUN/hangs/<job>_<attempt>/``, and one records the hang and requeues the job within ``slurm.max_hangs``, before the
time limit takes the allocation. A rank is armed once its main thread runs Python after the signal, or once it agreed
on the signal with the others: a rank stuck in C++ since before both is not, and the summary marks it as silent.
``watchdog.stall_s: 0`` turns this off.

**No warning by its time.** Where Slurm's warning never comes (a site or container setup it does not reach),
``arm_own_warnings`` sends it to rank 0 itself at ``end - slurm.signal_lead_s`` (``ddp_core.cluster.deadline``),
unless it came: the exchange above then carries it to every rank, and the script's handler runs as for Slurm's. It
sends it too when the batch node of a job with spare nodes dies (``ddp_core.cluster.batch_node``), so that the
script checkpoints and requeues the job, which would otherwise run on with no batch script to watch it.

Every rank must call ``optimizer.step`` equally often (DDP, FSDP and Lightning do): the exchange is a collective.
Torch is imported when the script installs its first handler (it has imported torch by then).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, Optional

from ddp_core.cluster import batch_node, deadline, signals
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.preemption import StopFlag
from ddp_core.config import Config, WatchdogConfig
from ddp_core.run.rundir import RunDir
from ddp_core.trainer.watchdog import Watchdog, attempt_folder

log = logging.getLogger("ddp_core.script")

OnHang = Callable[[Any, str, Optional[int]], int]
# The time between two exchanges of the flag (the trainer's default train.stop_check_ms: train.* is the trainer's own).
EXCHANGE_S = 0.1


class DeferredWarning:
    """One per script-mode rank: see the module docstring. ``intercept()`` once, before the script runs; ``close()``
    after it."""

    def __init__(self, cfg: Config, run_dir: RunDir, env: DistEnv, on_hang: OnHang) -> None:
        self.cfg, self.run_dir, self.env, self.on_hang = cfg, run_dir, env, on_hang
        self.warning = signals.warning_signal(cfg.slurm.warning)
        self.flag = StopFlag(cfg.slurm.warning, EXCHANGE_S, handlers=False)
        self.handler: Optional[Callable[[int, Optional[FrameType]], Any]] = None  # the script's, kept
        self.steps = 0  # optimizer steps this attempt, every rank counts the same
        self.watchdog: Optional[Watchdog] = None
        self._hooked = False
        self._recording = False  # flag_signal is the real handler (the warning released)
        self._grouped = False
        self._delivering = False

    def intercept(self) -> None:
        """From now on the script's handler for the warning signal is kept and called here (module docstring)."""
        signals.hold(self.warning)  # held already in a task ddpjob started; not if started by hand
        signals.install(self.warning, signal.SIG_DFL)  # blocked: a pending one stays pending
        real_getsignal = signal.getsignal

        def getsignal_(signalnum: int) -> signals.Handler:
            if signalnum == self.warning and (self.handler is not None or self._recording):
                return self.handler or signal.SIG_DFL  # what the script set, not the recorder in its place
            return real_getsignal(signalnum)

        def signal_(signalnum: int, handler: signals.Handler) -> signals.Handler:
            if signalnum != self.warning or threading.current_thread() is not threading.main_thread():
                return signals.install(signalnum, handler)  # also raises as Python does off the main thread
            previous = getsignal_(signalnum)
            self._take(handler)
            return previous

        signal.signal, signal.getsignal = signal_, getsignal_

    def _take(self, handler: signals.Handler) -> None:
        if callable(handler):
            self.handler = handler
            self._hook()
            if not self._recording:
                self._recording = True
                signals.install(self.warning, self.flag_signal)
                signals.release(self.warning)  # one held meanwhile is recorded now
            elif self.flag.received and not _several_ranks():
                self.flag_signal(self.flag.received, None)  # recorded while the script had no handler
            return
        self.handler = None
        if handler == signal.SIG_DFL and self._recording:
            # Released since: threads started meanwhile (this module's watchdog, the script's own) would let the
            # default end the process. The recorder stays; a later handler of the script's gets what it recorded.
            return
        self._recording = False
        signals.install(self.warning, handler)

    def _hook(self) -> None:
        if self._hooked:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(self._before_step)
        self._hooked = True

    def flag_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        """The warning's real handler: record it, arm the watchdog; call the script's handler at once only where no
        other rank can disagree."""
        first = not self.flag.received
        self.flag.record(signum, frame)
        if self.handler is None:
            return  # the script took its handler away (SIG_DFL): kept for the next one it installs
        self._arm_watchdog()
        if not _several_ranks():
            self.flag.clear()
            self._deliver(signum, frame)
        elif first and self.env.is_main:
            log.info("%s received: the script's handler runs at the next optimizer step all ranks agree on",
                     self.warning.name)  # fmt: skip

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.watchdog is not None:
            self.watchdog.beat(self.steps)
        if self._delivering or not _several_ranks():
            return
        if not self._grouped:
            self.flag.group = _cpu_group()
            self._grouped = True
        agreed = self.flag.agree()
        if agreed and self.handler is not None:
            self.flag.clear()
            self._arm_watchdog()  # also on a rank the signal itself never reached
            if self.env.is_main:
                log.info("%s: every rank calls the script's handler at optimizer step %d", self.warning.name,
                         self.steps)  # fmt: skip
            self._deliver(agreed, sys._getframe(1))

    def _deliver(self, signum: int, frame: Optional[FrameType]) -> None:
        handler = self.handler
        if handler is None:
            return
        self._delivering = True
        try:
            handler(signum, frame)
        finally:
            self._delivering = False

    def _arm_watchdog(self) -> None:
        stall_s = min(self.cfg.watchdog.stall_s, self.cfg.slurm.signal_lead_s / 2)
        if self.watchdog is not None or stall_s <= 0:
            return
        folder = attempt_folder(self.run_dir.hangs, self.env)
        limits = WatchdogConfig(stall_s=stall_s, first_step_s=stall_s)
        self.watchdog = Watchdog(limits, folder, self.env.rank, self.env.world_size, self.on_hang).start()
        if self.steps:
            self.watchdog.beat(self.steps)

    def arm_own_warnings(self) -> None:
        """Every srun launcher: rank 0's sends the warning to this process at ``end - slurm.signal_lead_s`` if it has
        not come by then, recorded or held, and when the batch node is gone (module docstring); an elastic job's
        second node's first launcher watches the batch node that rank 0 dies with (``batch_node.watch``). Call it
        while this thread holds the warning and SIGTERM: the threads it starts inherit the mask."""
        due = deadline.warning_due(self.cfg.slurm, self.env) if self.env.is_main else None
        if due is not None:
            why = f"by {self.cfg.slurm.signal_lead_s} s before the time limit (slurm.signal_lead_s)"
            deadline.at(due, lambda: self._warn_unless_signalled(why), "deadline-warning")
        batch_node.watch(self.cfg.slurm, self.env, self.run_dir, self._warn_for_lost_batch_node)

    def _warn_for_lost_batch_node(self, host: str) -> None:
        if batch_node.script_told(self.cfg.slurm, host):
            self._warn_unless_signalled(f"since batch node {host} is gone")

    def _warn_unless_signalled(self, why: str) -> None:
        if self.flag.received_at or self.warning in signal.sigpending():
            return  # Slurm's came (a second one would run the script's handler twice)
        log.warning("no %s %s: ddpjob sends it itself", self.warning.name, why)
        os.kill(os.getpid(), self.warning)

    def close(self) -> None:
        """The script returned: no stall to watch for any more."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None


def _several_ranks() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _cpu_group() -> Any:
    """The group the flag is exchanged on: the default group when it serves CPU tensors (gloo), else a gloo group of
    its own, created here by every rank in the same step."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend()):
        return None
    return dist.new_group(backend="gloo")
