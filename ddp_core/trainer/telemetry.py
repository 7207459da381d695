"""Throughput and efficiency in every progress line (``train.telemetry``, docs/performance.md): samples/s and
tokens/s, MFU, the fraction of step time spent waiting for data, step-time p50/p95 over the line's window, peak
memory, and where NVML is, GPU utilisation, power and energy (``gpu_meter``).

Each rank's own figures (its data wait, peak host memory, GPU readings) ride in the progress line's one all-gather
(``progress.ProgressLines``): no collective of their own. Per step the only cost is one clock read
(``tick``). MFU is the model FLOPs the task declares (``Task.flops_per_sample``) at the line's rate over the peak of
every device (``peak_flops``); without either figure it is left out, never made up.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from typing import Any

import torch
from torch import nn

from ddp_core.cluster.env import DistEnv
from ddp_core.config import SINGLE_PROCESS_STRATEGIES, Config
from ddp_core.tasks.base import Task
from ddp_core.trainer.gpu_meter import GpuMeter
from ddp_core.trainer.peak_flops import peak_tflops

log = logging.getLogger(__name__)
FIELDS = 5  # per rank: data wait (ms/step), peak host memory (GB), GPU utilisation (%), power (W), energy (J)


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of sorted values, by linear interpolation (numpy's default)."""
    if not sorted_values:
        return math.nan
    at = (len(sorted_values) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (at - low)


def mfu(samples_per_s: float, flops_per_sample: float, peak_tflops_per_device: float, devices: int) -> float:
    """Model FLOPs utilisation: the FLOPs the model's training did per second over the devices' peak."""
    return samples_per_s * flops_per_sample / (peak_tflops_per_device * 1e12 * devices)


class Telemetry:
    """One attempt's throughput figures; ``off`` when ``train.telemetry`` is false (nothing per step, no fields)."""

    def __init__(self, cfg: Config, env: DistEnv, device: torch.device, task: Task, model: nn.Module) -> None:
        self.on = cfg.train.telemetry
        self.step_s: list[float] = []  # this window's step times
        self.ticked = time.perf_counter()
        self.flops = task.flops_per_sample(model)  # the plain model, before a strategy wraps or cuts it
        self.tokens = task.tokens_per_sample()
        self.peak, source = peak_tflops(cfg, device)
        single_process = cfg.strategy.name in SINGLE_PROCESS_STRATEGIES and device.type == "cuda"
        self.devices = env.world_size * (max(1, torch.cuda.device_count()) if single_process else 1)
        self.gpu = GpuMeter(cfg.train.gpu_telemetry if self.on else False, device)
        if env.is_main and self.on:
            if self.flops is None:
                log.info("no MFU: the task declares no FLOPs per sample (Task.flops_per_sample)")
            elif self.peak is None:
                log.info("no MFU: %s", source)
            else:
                log.info("MFU of %.4g FLOPs per sample against %g TFLOP/s per device x %d (%s)",
                         self.flops, self.peak, self.devices, source)  # fmt: skip

    def tick(self) -> None:
        """After every step: its time (perf_counter to perf_counter, whatever ran in between)."""
        now = time.perf_counter()
        self.step_s.append(now - self.ticked)
        self.ticked = now

    def local(self, steps: int, work: Any) -> list[float]:
        """This rank's fields for the line's all-gather: ``FIELDS`` of them, NaN when off (the same layout either
        way, so ``on`` may change between lines: bench/telemetry_overhead.py turns it on and off within one run)."""
        if not self.on:
            return [math.nan] * FIELDS
        rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux
        return [work.take_data_ms() / max(1, steps), rss_gb, *self.gpu.sample()]

    def combine(self, ranks: list[list[float]], step_ms: float, samples_per_step: int) -> dict[str, float]:
        """The line's figures from every rank's ``local`` fields; ``step_ms``: the window's mean step time."""
        if not self.on:
            return {}
        times = sorted(1000 * s for s in self.step_s)
        self.step_s = []
        rate = 1000 * samples_per_step / step_ms if step_ms > 0 else math.nan
        out = {
            "samples_per_s": rate,
            "step_ms_p50": percentile(times, 50),
            "step_ms_p95": percentile(times, 95),
            "data_wait": max(r[0] for r in ranks) / step_ms if step_ms > 0 else math.nan,
            "peak_rss_gb": max(r[1] for r in ranks),
        }
        if self.tokens:
            out["tokens_per_s"] = rate * self.tokens
        if self.flops is not None and self.peak is not None and math.isfinite(rate):
            out["mfu"] = mfu(rate, self.flops, self.peak, self.devices)
        utils = [r[2] for r in ranks if math.isfinite(r[2])]
        if utils:
            out |= {"gpu_util": sum(utils) / len(utils), "gpu_util_min": min(utils)}
        for key, index in (("power_w", 3), ("energy_j", 4)):  # the job's: summed over the ranks that read it
            read = [r[index] for r in ranks if math.isfinite(r[index])]
            if read:
                out[key] = sum(read)
        return {k: v for k, v in out.items() if math.isfinite(v)}
