"""The performance keys of the train section: ``train.profile`` (a ``torch.profiler`` window, ProfileConfig) and the
login node's checks of it and of ``train.peak_tflops`` and ``train.gpu_telemetry`` (docs/performance.md)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddp_core.config.problems import require

if TYPE_CHECKING:
    from ddp_core.config.schema import TrainConfig

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


def nvml_missing(train: TrainConfig) -> bool:
    """``train.gpu_telemetry`` asked for on a machine without NVML's Python binding (``nvidia-ml-py``): a warning at
    submit, not an error (the ranks warn again and train on without it)."""
    return train.gpu_telemetry is True and importlib.util.find_spec("pynvml") is None
