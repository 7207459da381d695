"""A run's throughput for ``ddpjob status`` (and the report's page): its last progress line's samples/s, tokens/s,
MFU, data wait, step-time p50/p95 and peak memory (``ddp_core.trainer.telemetry``), the ETA to ``train.max_steps``
at that line's step time, and the GPU energy of the logged steps where NVML measured it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

Record = dict[str, Any]


def _number(record: Record, key: str) -> Optional[float]:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def last_line(metrics: list[Record]) -> Optional[Record]:
    """The newest train record with a throughput figure."""
    return next((r for r in reversed(metrics) if r.get("split") == "train" and _number(r, "samples_per_s")), None)


def energy_j(metrics: list[Record]) -> Optional[float]:
    """The GPU energy of every logged window, all ranks (None where NVML measured none). A window an attempt
    trained again after a failure counts once: the metrics log keeps only the steps that stand."""
    read = [v for r in metrics if r.get("split") == "train" and (v := _number(r, "energy_j")) is not None]
    return sum(read) if read else None


def joules(value: float) -> str:
    for unit, size in (("GJ", 1e9), ("MJ", 1e6), ("kJ", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit} ({value / 3.6e6:.3g} kWh)"
    return f"{value:.3g} J"


def describe(metrics: list[Record], max_steps: Optional[int]) -> Optional[str]:
    """``throughput: ...`` for the run's last line, or None before its first."""
    last = last_line(metrics)
    if last is None:
        return None
    parts = [f"{_number(last, 'samples_per_s'):,.0f} samples/s"]
    if (tokens := _number(last, "tokens_per_s")) is not None:
        parts.append(f"{tokens:,.0f} tokens/s")
    if (mfu := _number(last, "mfu")) is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    if (wait := _number(last, "data_wait")) is not None:
        parts.append(f"data wait {100 * wait:.0f}%")
    p50, p95 = _number(last, "step_ms_p50"), _number(last, "step_ms_p95")
    if p50 is not None and p95 is not None:
        parts.append(f"step p50 {p50:.3g} ms p95 {p95:.3g} ms")
    memory = [f"{v:.2f} GB {where}" for key, where in (("peak_mem_gb", "GPU"), ("peak_rss_gb", "host"))
              if (v := _number(last, key)) is not None]  # fmt: skip
    if memory:
        parts.append("peak " + ", ".join(memory))
    if (util := _number(last, "gpu_util")) is not None:
        parts.append(f"GPU util {util:.0f}%")
    if (power := _number(last, "power_w")) is not None:
        parts.append(f"{power:,.0f} W")
    text = f"throughput at step {last['step']}: " + ", ".join(parts)
    step_ms = _number(last, "step_ms")
    if max_steps is not None and step_ms is not None and last["step"] < max_steps:
        eta = timedelta(seconds=round((max_steps - last["step"]) * step_ms / 1000))
        text += f"; ETA {eta} to step {max_steps} (train.max_steps)"
    if (energy := energy_j(metrics)) is not None:
        text += f"; GPU energy {joules(energy)}"
    return text


def max_steps_of(config: Record) -> Optional[int]:
    """``train.max_steps`` from a run's config.yaml as read by YAML (None when it does not say)."""
    train = config.get("train") if isinstance(config, dict) else None
    value = train.get("max_steps") if isinstance(train, dict) else None
    return value if isinstance(value, int) else None
