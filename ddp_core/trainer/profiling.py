"""Profiles on demand: a ``torch.profiler`` trace per rank of a window of steps, written under ``RUN/profiles/`` as
Chrome trace JSON (Perfetto's https://ui.perfetto.dev opens it; so does TensorBoard's profiler plugin, each window a
run of ``tensorboard --logdir RUN/profiles``). Two ways in (docs/performance.md):

* ``train.profile: {start_step, steps}``: the steps after ``start_step``, set at submit.
* ``RUN/profile-now`` on a running job: while the file exists the ranks profile, from the next step that is a
  multiple of ``train.log_every`` (the same step on every rank, which all check there) for the steps the file says
  (a number; empty: ``train.profile.steps``, else 10), or until it is removed. Removing it turns profiling off at the
  next such step; the same file is served once (a new one, or a touch, asks again).

Between windows the loop pays two integer comparisons per step, and a ``stat`` of the file every ``log_every``
steps. Each window's folder is ``steps_<first>-<last>``; its ranks' traces ``rank<R>.pt.trace.json``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

from ddp_core.config import Config
from ddp_core.config.perf import MAX_PROFILE_STEPS, PROFILE_REQUEST

log = logging.getLogger(__name__)
REQUEST_STEPS = 10  # steps a request profiles when neither the file nor train.profile.steps says
PROFILES = "profiles"


class Profiler:
    """This rank's profile windows. ``after_step(step)`` after every optimizer step; ``close`` at the end."""

    def __init__(self, cfg: Config, run_path: Path, rank: int, device: torch.device) -> None:
        profile = cfg.train.profile
        self.window = (profile.start_step, profile.start_step + profile.steps) if profile.steps else None
        self.request, self.every = run_path / PROFILE_REQUEST, cfg.train.log_every
        self.request_steps = profile.steps or REQUEST_STEPS
        self.out, self.rank, self.cuda = run_path / PROFILES, rank, device.type == "cuda"
        self.served: Optional[tuple[int, int, int]] = None  # the request file whose window ran: not served again
        self.running: Optional[Any] = None  # the torch profiler of the window in progress
        self.first = self.last = 0  # the window in progress: the steps after ``first``, up to ``last``
        self.on_request = False

    def at_start(self, step: int) -> None:
        """The attempt's first step comes next: a window that starts here starts now."""
        if self.window is not None and step == self.window[0]:
            self.begin(step, self.window[1], False)

    def after_step(self, step: int) -> None:
        if self.running is not None:
            if step >= self.last or (self.on_request and step % self.every == 0 and not self.request.exists()):
                self.end(step)
            else:
                self.running.step()  # ends this step's ProfilerStep#N, begins the next one's
            return
        if self.window is not None and step == self.window[0]:
            self.begin(step, self.window[1], False)
        elif step % self.every == 0:
            self.check_request(step)

    def check_request(self, step: int) -> None:
        try:
            found = self.request.stat()
        except OSError:
            return
        stamp = (found.st_ino, found.st_mtime_ns, found.st_size)  # a rewrite within the clock's tick still differs
        if stamp == self.served:
            return
        self.served = stamp
        try:
            text = self.request.read_text().strip()
        except OSError:
            text = ""
        steps = int(text) if text.isdigit() and int(text) > 0 else self.request_steps
        self.begin(step, step + min(steps, MAX_PROFILE_STEPS), True)

    def begin(self, step: int, last: int, on_request: bool) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # A schedule that always records: torch then marks each step (ProfilerStep#N, which TensorBoard's plugin
        # splits the trace by), numbered as the run's steps; the window's length is ours to end.
        self.running = profile(activities=activities, schedule=lambda _: ProfilerAction.RECORD)
        self.running.step_num = step + 1
        self.running.start()
        self.first, self.last, self.on_request = step, last, on_request
        if self.rank == 0:
            why = f"{PROFILE_REQUEST} asked for it" if on_request else "train.profile"
            log.info("profiling steps %d-%d (%s)", step + 1, last, why)

    def end(self, step: int) -> None:
        """Stop the window after ``step`` and write this rank's trace."""
        running, self.running = self.running, None
        assert running is not None, "end() follows begin()"
        running.stop()
        folder = self.out / f"steps_{self.first + 1}-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.pt.trace.json"
        partial = path.with_name(path.name + ".partial")
        running.export_chrome_trace(str(partial))
        os.replace(partial, path)  # a reader never opens half a trace
        log.info("profile of steps %d-%d: %s (open it in https://ui.perfetto.dev)", self.first + 1, step, path)

    def close(self, step: Optional[int]) -> None:
        """The attempt ends (a signal, a failure, the end): a window in progress is written as far as it got."""
        if self.running is not None and step is not None:
            try:
                self.end(step)
            except Exception:  # teardown: a trace that cannot be written must not hide why the attempt ended
                log.exception("writing the profile of steps %d-%d", self.first + 1, step)
