"""``train.profile`` (a ``torch.profiler`` window, ProfileConfig), and the limits its checks and the trainer share;
the login node's checks of the performance keys are ``config.perf_checks`` (docs/performance.md)."""

from __future__ import annotations

from dataclasses import dataclass

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
