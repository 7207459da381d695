"""Hang watchdog: an attempt that stops making progress is dumped, recorded and requeued instead of holding its
allocation until the time limit.

Where it lives, and why
-----------------------
A daemon thread in every rank, backed by faulthandler's C-level timer.

* The training loop only records progress (``beat``: two attribute stores, no I/O, no collective), so the
  watchdog costs nothing per step.
* The thread wakes every ``poll_s``, publishes the rank's progress to ``RUN/hangs/<attempt>/rank<R>.json`` and
  checks how long ago the rank last progressed. A rank that waits in a collective waits with the GIL released
  (gloo and NCCL waits, sleeps, socket reads), so its thread still runs. When one rank hangs, every rank stalls
  (the others wait for it in the next collective) and every rank dumps its own Python stacks: the summary can
  tell the ranks stuck in user code from the ones waiting in torch.
* A main thread that holds the GIL and never gives it back (a C extension stuck without releasing it) stops
  every Python thread of its process. For that case faulthandler's own C thread is armed with a later
  deadline and re-armed by the watchdog thread while it runs: if it fires, it writes all threads' stacks and
  exits the process, and ``srun --kill-on-bad-exit`` ends the step. The other ranks' watchdogs still requeue.
* A Slurm suspension is not a hang: ``ddp_core.distributed.suspend`` tells the watchdog at the warning (SIGTSTP), which
  disarms the backstop and pauses the checks, and at resume, which restarts the clock. A process stopped without
  that warning shows as a gap in the watchdog thread's own wake-ups, and its clock restarts too (the backstop,
  then armed, fires at continue if the stop outlasted its deadline).
* A rank stopped during a long pause (the first step, a save), where its peers' own allowance is
  ``first_step_s``: each watchdog thread touches its rank's ``rank<R>.txt`` every tenth of ``stall_s``, so a rank
  that has waited in a collective for ``stall_s`` and finds a peer's beat that old declares the hang, that peer the
  suspect (before, only ``dist.timeout_s`` ended it, charged to the rank that timed out). A peer still at its own
  work (compiling, loading) keeps beating and is waited for.
* Not a per-node sidecar or the batch script: they see processes, not Python frames, and py-spy needs ptrace
  rights that clusters often withhold. A thread reads its own process's frames for free.

One rank coordinates a hang: the first to claim the attempt's summary (an exclusive create). It waits a moment
for the other ranks' dumps, writes ``summary.txt`` (each rank's step, host and innermost frame; suspects
first), then calls the trainer's ``on_hang`` (event, budget, requeue) and ends its process with the code that
returns. Torch-free: ``ddp_core.config`` takes ``WatchdogConfig`` from here.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any, Callable, Optional

from ddp_core.cluster.env import DistEnv, process_started
from ddp_core.cluster.exits import ExitCode, leave
from ddp_core.config import WatchdogConfig
from ddp_core.distributed import flight_recorder
from ddp_core.run.rundir import atomic_write_text

log = logging.getLogger(__name__)

SUMMARY = "summary.txt"
_HANG = "hang: "  # how a summary's first line (also the `hang` event's summary) starts
UNNAMED_RUN = "none"  # torchrun's run id when --rdzv-id is not given: not a job's identity
COORDINATOR = ".coordinator"  # created exclusively by the rank that summarises a hang
# How long the coordinator waits for the other ranks' dumps: they detect the same stall within one poll.
COLLECT_S = 5.0
# The C-level backstop fires this long after the Python watchdog would have (at most; never more than stall_s):
# time to dump, summarise and requeue.
BACKSTOP_MARGIN_S = 60.0
# Innermost frames in these parts of torch mean "waiting for the other ranks", not "stuck in its own work".
_WAITING_IN = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/", "torch/_tensor.py")


class Watchdog:
    """Per rank, for one attempt. ``beat(step)`` after each step; ``allowance()`` around long expected pauses."""

    def __init__(
        self,
        cfg: WatchdogConfig,
        folder: Path,
        rank: int,
        world_size: int,
        on_hang: Callable[[Path, str, Optional[int]], int],
        poll_s: Optional[float] = None,
    ) -> None:
        self.cfg, self.folder, self.rank, self.world_size, self.on_hang = cfg, folder, rank, world_size, on_hang
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.2, cfg.stall_s / 10))
        self.step: Optional[int] = None  # the last finished step; None until the attempt's first
        self.progressed = time.monotonic()
        self.long_pause = True  # until the first step: the first-step allowance applies
        self.paused = False  # a Slurm suspension: the job is stopped, not hung
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._backstop: Optional[IO[str]] = None
        self._beaten = 0.0  # when this thread last touched rank<R>.txt (monotonic)

    # --- the training loop's side: cheap ---------------------------------------------------------------------

    def beat(self, step: int) -> None:
        self.step, self.progressed = step, time.monotonic()
        if self.long_pause:  # the first step (or the end of an eval or a save): the stall allowance applies again
            self.long_pause = False
            self._arm_backstop(self.cfg.stall_s)  # now, not at the next poll: the GIL may never come back to it

    @property
    def enabled(self) -> bool:
        return self.cfg.stall_s > 0

    def start(self) -> Watchdog:
        if self.enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._backstop = open(self.folder / f"rank{self.rank}.txt", "a")
            self._thread = threading.Thread(target=self._watch, name="ddpjob-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """End of the attempt's training: no hang, so leave nothing behind in ``RUN/hangs``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 1)
        if self._backstop is not None:
            faulthandler.cancel_dump_traceback_later()
            self._backstop.close()
            self._backstop = None
            if (self.folder / COORDINATOR).exists():
                return  # a hang was declared (this rank then fails in its collective): keep every dump
            for name in (f"rank{self.rank}.txt", f"rank{self.rank}.json"):
                (self.folder / name).unlink(missing_ok=True)
            for folder in (self.folder, self.folder.parent):
                try:
                    folder.rmdir()  # only once empty: the last rank out removes it
                except OSError:
                    break

    def suspended(self, stopped: bool) -> None:
        """``distributed.suspend``'s listener: no hang is declared while the job is suspended, and the clock restarts
        when it resumes. The backstop is disarmed first: its C thread would fire the moment the process continues."""
        self.paused = stopped
        if stopped:
            if self._backstop is not None:
                faulthandler.cancel_dump_traceback_later()
        else:
            self.progressed = time.monotonic()
            self._arm_backstop(self._limit())

    def allowance(self) -> _Allowance:
        """``with watchdog.allowance():`` a pause that may last up to ``first_step_s`` (a checkpoint save)."""
        return _Allowance(self)

    # --- the watchdog thread --------------------------------------------------------------------------------------

    def _limit(self) -> float:
        return self.cfg.first_step_s if self.long_pause else self.cfg.stall_s

    def _watch(self) -> None:
        woke = time.monotonic()
        while not self._stop.wait(self.poll_s):
            now, last = time.monotonic(), woke
            woke = now
            if self.paused:  # a suspension announced by its warning signal (ddp_core.distributed.suspend)
                continue
            if now - last > 3 * self.poll_s + 5:
                # This thread did not run for a while: the process was stopped (kill -STOP, a suspension whose
                # warning the main thread had no chance to handle) or starved. Time it was not running is not a stall.
                log.warning("watchdog: this process did not run for %.0f s; its stall clock restarts", now - last)
                self.progressed = max(self.progressed, now)
            stalled = now - self.progressed
            self._arm_backstop(self._limit() - stalled)
            self._beat(now)
            if stalled > min(self._limit(), self.cfg.stall_s) / 2:  # for the coordinator's summary if a hang follows
                self._publish(stalled)
            if stalled > self._limit() or (stalled > self.cfg.stall_s and self._waits_on_silent_peer()):
                self._hang(stalled)
                return

    def _beat(self, now: float) -> None:
        """This rank's sign of life to its peers (``silent_peers``): its thread runs, so the process is not stopped."""
        if now - self._beaten >= self.cfg.stall_s / 10:
            self._beaten = now
            try:
                os.utime(self.folder / f"rank{self.rank}.txt")
            except OSError:
                pass  # a full or failing filesystem: no beat; peers then wait as before

    def _waits_on_silent_peer(self) -> bool:
        """In a long pause: this rank waits in torch (a collective) while a peer's beat is ``stall_s`` old."""
        if not self.long_pause or not _waiting(_main_frame()):
            return False
        silent = self.silent_peers()
        if silent:
            log.error("ranks %s gave no sign of life for %g s while this rank waits for them", silent, self.cfg.stall_s)
        return bool(silent)

    def silent_peers(self) -> list[int]:
        """Ranks whose beat (their ``rank<R>.txt``'s mtime) is older than ``stall_s``: their process is stopped or
        stuck holding its GIL. A rank that has not started its watchdog yet has no file and is not counted."""
        silent, now = [], time.time()
        for r in range(self.world_size):
            try:
                if r != self.rank and now - (self.folder / f"rank{r}.txt").stat().st_mtime > self.cfg.stall_s:
                    silent.append(r)
            except OSError:
                continue
        return silent

    def _arm_backstop(self, left_s: float) -> None:
        """Fire ``left_s`` plus a margin from now. Re-armed at every poll, so it fires only when this thread stops
        running (the main thread holds the GIL): then it keeps the deadline of the last arming."""
        if self._backstop is not None:
            after_s = max(0.0, left_s) + min(BACKSTOP_MARGIN_S, self.cfg.stall_s)
            faulthandler.dump_traceback_later(after_s, exit=True, file=self._backstop)

    def _publish(self, stalled: float, frame: str = "") -> None:
        record = {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "step": self.step,
            "stalled_s": round(stalled, 1),
            "frame": frame or _main_frame(),
        }
        atomic_write_text(self.folder / f"rank{self.rank}.json", json.dumps(record) + "\n")

    def _hang(self, stalled: float) -> None:
        frame = _main_frame()
        self._publish(stalled, frame)
        faulthandler.cancel_dump_traceback_later()
        with open(self.folder / f"rank{self.rank}.txt", "w") as f:
            f.write(
                f"rank {self.rank}/{self.world_size} on {self.host} pid {os.getpid()}: no progress for "
                f"{stalled:.0f} s after step {self.step}\n\n{_all_stacks()}"
            )
        recorder = flight_recorder.dump(self.folder, self.rank)  # on GPUs: the NCCL collectives in flight
        if recorder is not None:
            log.error("NCCL flight recorder: %s", recorder)
        log.error(
            "no progress for %.0f s after step %s (in %s): stacks in %s",
            stalled,
            self.step,
            frame,
            self.folder / f"rank{self.rank}.txt",
        )
        if not self._claim():
            # Another rank coordinates (it requeues or ends the job); leave if that does not end this process. Alive
            # meanwhile: its beat goes on, so the coordinator does not take it for the stopped one.
            until = time.monotonic() + COLLECT_S + 120
            while time.monotonic() < until:
                self._beat(time.monotonic())
                time.sleep(self.poll_s)
            leave(ExitCode.FAILED)
        time.sleep(COLLECT_S)
        summary = self._summarise()
        (self.folder / SUMMARY).write_text(summary)
        for line in summary.splitlines():
            log.error("%s", line)
        code = 1
        try:
            code = self.on_hang(self.folder, summary.splitlines()[0], self.step)
        finally:
            leave(code)

    def _claim(self) -> bool:
        try:
            os.close(os.open(self.folder / COORDINATOR, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def _summarise(self) -> str:
        ranks = []
        for r in range(self.world_size):
            try:
                ranks.append(json.loads((self.folder / f"rank{r}.json").read_text()))
            except (OSError, ValueError):
                ranks.append({"rank": r, "host": "?", "step": None, "frame": "no report (process stuck or gone)"})
        silent = self.silent_peers()  # a stopped rank publishes nothing: its stale beat names it
        suspects = [ranks[r] for r in silent] if silent else _suspects(ranks)
        who = ", ".join(f"rank {r['rank']} on {r['host']}" for r in suspects)
        lines = [f"{_HANG}no progress for {self.cfg.stall_s:g} s; suspect {who} (stacks: {self.folder})"]
        for r in ranks:
            mark = "*" if r in suspects else " "
            lines.append(f"{mark} rank {r['rank']:>4} on {r['host']}: step {r.get('step')}, in {r.get('frame')}")
        return "\n".join(lines) + "\n"


class _Allowance:
    def __init__(self, dog: Watchdog) -> None:
        self.dog = dog

    def __enter__(self) -> None:
        self.dog.progressed, self.dog.long_pause = time.monotonic(), True
        self.dog._arm_backstop(self.dog.cfg.first_step_s)

    def __exit__(self, *exc: Any) -> None:
        if self.dog.step is not None:
            self.dog.beat(self.dog.step)


def _waiting(frame: str) -> bool:
    """Whether a rank's innermost frame waits for the other ranks (in torch's collectives or autograd)."""
    return any(part in frame for part in _WAITING_IN)


def _suspects(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks stuck in their own code (or silent) when others wait in torch; else the ranks furthest behind."""
    own = [r for r in ranks if not _waiting(str(r.get("frame")))]
    if own and len(own) < len(ranks):
        return own
    steps = [r["step"] for r in ranks if isinstance(r.get("step"), int)]
    low = min(steps, default=None)
    behind = [r for r in ranks if r.get("step") == low] if low is not None else ranks
    return behind if len(behind) < len(ranks) else ranks


def _main_frame() -> str:
    """The main thread's innermost frame, ``path:line in function``."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return "unknown"
    last = traceback.extract_stack(frame)[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def _all_stacks() -> str:
    """Every thread's stack but the watchdog's own, the main thread first, with source lines."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    main, me = threading.main_thread().ident, threading.get_ident()
    parts = []
    for ident in sorted((i for i in frames if i != me), key=lambda i: i != main):
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n")
        parts.extend(traceback.format_stack(frames[ident]))
        parts.append("\n")
    return "".join(parts)


def cause(summary: str) -> str:
    """A hang summary's first line without its ``hang:`` label: what status and logs print after their own."""
    return summary.removeprefix(_HANG)


def attempt_folder(hangs: Path, env: DistEnv) -> Path:
    """``RUN/hangs/<job>_<attempt>``: every rank of an attempt derives the same one without talking (the attempt: the
    requeue's count, then ``.<n>`` for torchrun's n-th restart of its workers inside it). Ranks started by hand, with
    no launcher's job id (or torchrun's default run id, ``none``, the same for every run), share only their rendezvous
    port: ``local-<port>-<n>``, the first ``n`` whose folder is not an earlier attempt's (one whose hang was claimed
    before this process started). A process alone adds its pid (each start is another attempt)."""
    if env.job_id and env.job_id != UNNAMED_RUN:
        again = f".{env.elastic_restart}" if env.elastic_restart else ""
        return hangs / f"{env.job_id}_{env.restart_count}{again}"
    if not env.distributed:
        return hangs / f"single-{os.getpid()}"
    started, n = process_started() or 0.0, 0
    while _earlier(hangs / f"local-{env.master_port}-{n}", started):
        n += 1
    return hangs / f"local-{env.master_port}-{n}"


def _earlier(folder: Path, started: float) -> bool:
    try:
        return (folder / COORDINATOR).stat().st_mtime < started
    except FileNotFoundError:
        return False
