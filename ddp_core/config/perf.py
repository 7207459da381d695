"""The performance keys of the train section: ``train.profile`` (a ``torch.profiler`` window, ProfileConfig) and the
login node's checks of it and of ``train.peak_tflops`` and ``train.gpu_telemetry`` (docs/performance.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddp_core.config.problems import require

if TYPE_CHECKING:
    from ddp_core.config.schema import TrainConfig

log = logging.getLogger(__name__)
MAX_PROFILE_STEPS = 1000  # a trace of more steps is gigabytes per rank that neither Perfetto nor TensorBoard opens
PROFILE_REQUEST = "profile-now"  # RUN/profile-now: a running job profiles while the file is there (docs/performance.md)


@dataclass
class ProfileConfig:
    """A ``torch.profiler`` trace per rank of a window of steps, under RUN/profiles/."""

    # Profile the steps after this one (0: from the first step of the run).
    start_step: int = 0
    # Steps in the window (0: none). Also how many steps a request of a running job (RUN/profile-now) profiles when
    # the file does not say.
    steps: int = 0


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
