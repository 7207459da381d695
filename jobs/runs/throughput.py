"""A run's throughput for ``ddpjob status`` (and the report's page): its last progress line's samples/s, tokens/s,
MFU, data wait, step-time p50/p95 and peak memory (``ddp_core.trainer.telemetry``), the ETA to ``train.max_steps``
at that line's step time, and the GPU energy of the logged steps where NVML measured it. ``live_line``: the same
figures in the one line ``submit --wait`` keeps up to date, with the job's state from Slurm.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from ddp_core.cluster.slurm import QueuedJob
    from ddp_core.run.rundir import RunDir

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
    if (eta := eta_of(last, max_steps)) is not None:
        text += f"; ETA {eta} to step {max_steps} (train.max_steps)"
    if (energy := energy_j(metrics)) is not None:
        text += f"; GPU energy {joules(energy)}"
    return text


def max_steps_of(config: Record) -> Optional[int]:
    """``train.max_steps`` from a run's config.yaml as read by YAML (None when it does not say)."""
    train = config.get("train") if isinstance(config, dict) else None
    value = train.get("max_steps") if isinstance(train, dict) else None
    return value if isinstance(value, int) else None


def eta_of(last: Record, max_steps: Optional[int]) -> Optional[timedelta]:
    """The time to ``max_steps`` at the line's step time; None when done or not known."""
    step_ms = _number(last, "step_ms")
    if max_steps is None or step_ms is None or last["step"] >= max_steps:
        return None
    return timedelta(seconds=round((max_steps - last["step"]) * step_ms / 1000))


def max_steps_in(run: RunDir) -> Optional[int]:
    """``train.max_steps`` from the run's config.yaml (None when it does not say, or the file is damaged)."""
    import yaml  # plain YAML: the config tree (OmegaConf) is not needed for one number

    try:
        return max_steps_of(yaml.safe_load(run.config_file.read_bytes()))
    except (OSError, ValueError, RecursionError, yaml.YAMLError):  # ValueError: not UTF-8; a damaged file has no ETA
        return None


def restarts_in(events: list[Record]) -> int:
    """The attempts that were restarts, from the run's own records (``ddpjob status``'s count where sacct adds none)."""
    return sum(1 for e in events if e["event"] == "start" and isinstance(e.get("restart_count"), int)
               and e["restart_count"] > 0)  # fmt: skip


def live_line(
    job_id: str, queued: Optional[QueuedJob], events: list[Record], metrics: list[Record], max_steps: Optional[int]
) -> str:
    """``submit --wait``'s line: ``job 5301 PENDING (Resources), start estimate 2026-12-01T10:00:00`` while Slurm
    holds it back; once it runs ``job 5301 RUNNING, step 40/60, 85.2 steps/s, loss 0.512, ETA 0:00:02, restarts 0``
    from the run's files. A start the files record before Slurm was asked again reads RUNNING."""
    state = queued.state if queued is not None else "LEFT THE QUEUE"
    started = [e for e in events if e["event"] == "start" and str(e.get("job_id")) == job_id]
    if queued is not None and state == "PENDING" and started and started[-1].get("restart_count") == queued.restarts:
        state = "RUNNING"
    if state == "PENDING" and queued is not None:
        estimate = f"start estimate {queued.start_time}" if queued.start_time else "no start estimate yet"
        return f"job {job_id} PENDING ({queued.reason or 'None'}), {estimate}"
    parts = [f"job {job_id} {state}"]
    train = [r for r in metrics if r.get("split") == "train"]
    if not train:
        return ", ".join([*parts, "no step yet"])
    last = train[-1]
    parts.append(f"step {last['step']}/{max_steps}" if max_steps else f"step {last['step']}")
    if (step_ms := _number(last, "step_ms")) is not None and step_ms > 0:
        parts.append(f"{1000 / step_ms:.3g} steps/s")
    if (loss := _number(last, "loss")) is not None:
        parts.append(f"loss {loss:.4g}")
    if (eta := eta_of(last, max_steps)) is not None:
        parts.append(f"ETA {eta}")
    return ", ".join([*parts, f"restarts {restarts_in(events)}"])
