"""Per-rank RNG state (Python, NumPy, torch, CUDA): seeding, capture for a checkpoint, restore on resume, and a block
that leaves the streams as it found them (``rng_untouched``: evaluations must not shift the training's randomness)."""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator, cast

import numpy as np
import torch


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This rank's RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    # The legacy tuple form (get_state's default): numpy's stubs type it as a union with the dict form.
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    name, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def rng_untouched() -> Iterator[None]:
    """This rank's RNG streams (Python, NumPy, torch, CUDA) as they were before the block, whatever it drew: an
    evaluation (a DataLoader iterator draws its seed from torch's stream, a task may sample) must not shift the
    training's randomness, or a run extended after its final evaluation, or evaluated on another cadence, would not
    end on the bits of a run that never stopped."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
