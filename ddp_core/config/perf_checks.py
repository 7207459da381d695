"""The login node's checks of the performance keys: ``train.peak_tflops``, the ``train.profile`` window against
``train.max_steps``, and ``train.gpu_telemetry`` where NVML's binding is missing (a warning, not a refusal)."""

from __future__ import annotations

import logging

from ddp_core.config.perf import MAX_PROFILE_STEPS
from ddp_core.config.problems import require
from ddp_core.config.schema import TrainConfig

log = logging.getLogger(__name__)


def validate_perf(train: TrainConfig) -> None:
    """``train.peak_tflops`` and ``train.profile`` against their ranges and ``train.max_steps``."""
    peak = train.peak_tflops
    require(peak is None or peak > 0, "train.peak_tflops", peak, "must be > 0 (the peak TFLOP/s of one GPU)")
    profile = train.profile
    require(profile.start_step >= 0, "train.profile.start_step", profile.start_step, "must be >= 0")
    require(
        0 <= profile.steps <= MAX_PROFILE_STEPS,
        "train.profile.steps",
        profile.steps,
        f"must be in [0, {MAX_PROFILE_STEPS}] (a few steps are enough for a trace)",
    )
    if profile.steps:
        end = profile.start_step + profile.steps
        require(
            end <= train.max_steps,
            "train.profile.start_step",
            profile.start_step,
            f"the window (steps {profile.start_step + 1}-{end}) ends beyond train.max_steps ({train.max_steps})",
        )


def warn_without_nvml(train: TrainConfig) -> bool:
    """``train.gpu_telemetry=true`` on a machine without NVML's Python binding (``nvidia-ml-py``): one warning line
    at submit (once per process: a sweep checks each trial), not an error; the ranks warn again where they lack it
    too, and train on without it. Returns whether it warned."""
    if train.gpu_telemetry is not True or _warned:
        return False
    try:
        import pynvml  # noqa: F401  # ctypes bindings: the library itself loads only at nvmlInit
    except ImportError:
        pass
    else:
        return False
    globals()["_warned"] = True
    log.warning(
        "train.gpu_telemetry=true, but nvidia-ml-py is not installed here: ranks without it train on without GPU "
        "telemetry (pip install 'ddpjob[gpu]' where they run)"
    )
    return True


_warned = False
