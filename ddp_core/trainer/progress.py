"""Where a run's numbers go: ``Records`` (the metrics log and the experiment trackers, from rank 0) and
``ProgressLines`` (the progress line every ``train.log_every`` steps: loss, step time, throughput, GPU memory, the
task's train sums, stragglers).

A line is gathered in the background: every rank's (loss sum, steps, peak GPU memory, work per step, train sums) go
out in one all-gather that gloo's thread runs while the ranks go on with the next step, and ``finish`` writes the
line after it (a blocking gather here cost 1.2-1.8 ms per line on 2 CPU ranks, 1.5% of the tiny model's steps at
log_every 25).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Optional

import torch

from ddp_core.cluster.env import DistEnv
from ddp_core.config import Config
from ddp_core.distributed import collectives, groups, straggler
from ddp_core.errors import DdpJobError
from ddp_core.run.reporting import MetricsLog, Progress
from ddp_core.run.rundir import RunDir
from ddp_core.trackers import Outcome, Trackers, open_trackers
from ddp_core.trainer.metrics import RunningLoss, TrainSums
from ddp_core.trainer.telemetry import FIELDS, Telemetry

log = logging.getLogger(__name__)


class Records:
    """Rank 0's metrics log and experiment trackers (``log.trackers``); a no-op on the other ranks."""

    def __init__(self, cfg: Config, run_dir: RunDir, env: DistEnv, step: int) -> None:
        self.metrics_log = MetricsLog(run_dir.metrics_file, step) if env.is_main else None
        # Steps an earlier attempt already sent to the trackers (it died after its last checkpoint) are not sent
        # again: their steps stay strictly increasing across attempts; the local metrics log was rewound instead.
        skip = self.metrics_log.previous_last_step if self.metrics_log else -1
        self.trackers = open_trackers(cfg, run_dir, skip) if env.is_main else Trackers([])

    def record(self, split: str, metrics: dict[str, float], step: int) -> None:
        if self.metrics_log is not None:
            self.metrics_log.write(step, split, metrics)
        self.trackers.metrics({f"{split}/{k}": v for k, v in metrics.items()}, step)

    def sync(self) -> None:
        """The metrics log on disk up to now: before a checkpoint, which a resumed attempt rewinds it to."""
        if self.metrics_log is not None:
            self.metrics_log.sync()

    def finish(self, outcome: Outcome) -> None:
        if self.metrics_log is not None:
            self.metrics_log.close()
        self.trackers.finish(outcome)


class ProgressLines:
    """The progress lines of one attempt: ``start`` at a step that has one, ``finish`` at the next step (or before
    anything that reads the metrics log or the loss: an evaluation, a checkpoint, the end)."""

    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        device: torch.device,
        samples_per_step: int,
        step: int,
        log_loss: RunningLoss,
        train_sums: TrainSums,
        work: Any,
        lr: Callable[[], float],
        records: Records,
        telemetry: Telemetry,
    ) -> None:
        self.cfg, self.env, self.device, self.telemetry = cfg, env, device, telemetry
        self.samples_per_step = samples_per_step
        self.own = 4 + FIELDS  # each rank's gathered values before its train sums (NaN for telemetry that is off)
        self.log_loss, self.train_sums, self.work, self.lr, self.records = log_loss, train_sums, work, lr, records
        self.progress = Progress(step, cfg.train.max_steps, samples_per_step, enabled=env.is_main)
        self.hosts: list[str] = []  # which host each rank is on (at the first line): the straggler report's
        self.spreads: list[dict[str, Any]] = []  # the ranks' work per step, one entry per line
        self.logged_at, self.logged_step = time.perf_counter(), step  # step time is measured between lines
        self.line: Optional[tuple[int, dict[str, float], Callable[[], list[list[float]]]]] = None

    def after_step(self, step: int) -> None:
        if self.telemetry.on:
            self.telemetry.tick()
        self.finish()  # the last step's, if it had one
        if step % self.cfg.train.log_every == 0 or step == self.cfg.train.max_steps:
            self.start(step)

    def start(self, step: int) -> None:
        assert self.line is None, "the loop finishes the last line before it starts the next"
        # The loss read-back synchronises with the device first: the forward timings' events have completed.
        state = self.log_loss.totals()  # the interval's only host-device sync
        steps = max(1, step - self.logged_step)
        values = [
            *state,
            groups.peak_memory_gb(self.device) or 0,
            self.work.take_ms() / steps,
            *self.telemetry.local(steps, self.work),
            *self.train_sums.take(),
        ]
        self.log_loss.reset()
        now = time.perf_counter()
        known = {"lr": self.lr(), "step_ms": 1000 * (now - self.logged_at) / steps}
        self.line = (step, known, collectives.all_gather_floats_async(values))
        self.logged_at, self.logged_step = now, step

    def finish(self) -> None:
        """Write the line in flight, if any."""
        if self.line is None:
            return
        step, known, gather = self.line
        self.line = None
        ranks = gather()
        metrics = {"loss": sum(r[0] for r in ranks) / max(1.0, sum(r[1] for r in ranks)), **known}
        # The task's train-step sums and the grad norm, averaged over ranks; train/loss stays the step losses' mean.
        sums = self.train_sums.combine([r[self.own :] for r in ranks])
        metrics |= {k: v for k, v in sums.items() if k not in metrics}
        if self.device.type == "cuda":  # the largest and smallest peak over ranks: imbalance shows as a gap
            metrics |= {"peak_mem_gb": max(r[2] for r in ranks), "peak_mem_gb_min": min(r[2] for r in ranks)}
        # Throughput over the line's window (train.telemetry); without it, samples/s since the attempt started.
        metrics |= {"samples_per_s": self.progress.rate(step)[1]}
        metrics |= self.telemetry.combine([r[4 : self.own] for r in ranks], metrics["step_ms"], self.samples_per_step)
        self.progress.update(step, metrics)
        spread = self._spread(ranks, metrics["step_ms"])
        self.records.record("train", metrics | spread, step)
        if self.cfg.train.stop_on_nan and not math.isfinite(metrics["loss"]):
            # Every rank read the same gathered loss: all of them stop here, none is left in a collective, and
            # none has saved a checkpoint since (a checkpoint finishes the line first).
            raise DdpJobError(
                f"the training loss became {metrics['loss']} by step {step}",
                "lower optim.lr, set optim.grad_clip or warmup; the last checkpoint is from before it "
                "(train.stop_on_nan=false trains on)",
            )

    def _spread(self, ranks: list[list[float]], step_ms: float) -> dict[str, Any]:
        """The ranks' own work per step, and the straggler among them if one is persistently slow."""
        if len(ranks) <= 1:
            return {}
        if not self.hosts:
            self.hosts.extend(collectives.hosts())  # every rank is at this line: one object all-gather per attempt
        spread = straggler.spread([r[3] for r in ranks], self.hosts)
        if spread:
            self.spreads.append(spread | {"step_ms": step_ms})
            del self.spreads[: -straggler.LINES]
            slow = straggler.persistent(self.spreads, self.cfg.train.straggler_factor)
            if slow is not None:
                spread["straggler_rank"] = slow
            if slow is not None and self.env.is_main:
                log.warning(
                    "rank %d on %s is a straggler: %.1f ms of its own work per step, median %.1f",
                    slow,
                    self.hosts[slow],
                    spread["work_ms_max"],
                    spread["work_ms_median"],
                )
        return spread

    def close(self) -> None:
        self.progress.close()
