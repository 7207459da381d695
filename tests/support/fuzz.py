"""Hypothesis settings for the property-based tests: reproducible by default, ``DDPJOB_FUZZ_SCALE=N`` hunts."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def fuzz(examples: int, scalable: bool = True) -> settings:
    """Reproducible settings: derandomized (the same inputs on every run), no example database, no deadline (the
    first example imports torch). ``DDPJOB_FUZZ_SCALE=N`` (N > 1) hunts instead: N times the examples, drawn at
    random (pytest prints the seed of a failure; ``--hypothesis-seed=S`` repeats it). The counts are a regression
    sample, the same inputs on every run: finding new bugs is what a hunt is for, and each found stays an @example."""
    scale = int(os.environ.get("DDPJOB_FUZZ_SCALE", "1")) if scalable else 1
    return settings(
        max_examples=examples * scale,
        derandomize=scale == 1,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
    )
