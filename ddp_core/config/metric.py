"""One way to name a metric and its direction, for every place that ranks by one: ``checkpoint.monitor`` (and the
early stop), ``search.metric`` (and its pruner), ``ddpjob status --metric`` and ``ddpjob report --metric``.

``[min:|max:]SPLIT/NAME``, or a bare ``NAME`` for ``eval/NAME``:

- ``min:`` or ``max:`` says which way is better;
- without one, a name that ends in a word for a cost (``loss``, ``error``, ``perplexity``) is minimised and any
  other (``accuracy``, ``f1``, ...) maximised, so ``eval/loss`` means the same everywhere: lower is better.

Torch-free (the login node parses every one before anything is submitted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ddp_core.errors import DdpJobError

# Names ending in one of these are costs: lower is better.
COSTS = ("loss", "error", "perplexity")
EVAL_ONLY = ("eval",)


@dataclass(frozen=True)
class Metric:
    """A metric's key in ``metrics.jsonl`` (``eval/loss``) and whether lower is better."""

    key: str
    minimize: bool
    said: bool = field(default=False, compare=False)  # the direction was given (min:/max:), not read from the name

    @property
    def name(self) -> str:
        """The name without its split: ``eval/loss`` -> ``loss`` (what the trainer's evaluation returns)."""
        return self.key.partition("/")[2]

    @property
    def direction(self) -> str:
        """Optuna's word for it: ``minimize`` or ``maximize``."""
        return "minimize" if self.minimize else "maximize"

    @property
    def spec(self) -> str:
        """The explicit form, ``min:eval/loss``: what a run records so that nothing has to guess again."""
        return f"{'min' if self.minimize else 'max'}:{self.key}"

    def better(self, value: float, than: float) -> bool:
        return value < than if self.minimize else value > than


def parse_metric(text: str, where: str, splits: Sequence[str] = EVAL_ONLY) -> Metric:
    """``text`` as a ``Metric``; ``where`` names the key or option it came from, for the one-line error. ``splits``:
    the splits that have the metric (a run's evaluation has only ``eval``; its records have ``train`` too)."""
    prefix, sep, rest = str(text).strip().rpartition(":")
    key = rest if "/" in rest else f"eval/{rest}"
    split, _, name = key.partition("/")
    example = "e.g. eval/loss (lower is better), eval/accuracy (higher), or min:eval/NAME / max:eval/NAME"
    if sep and prefix not in ("min", "max"):
        raise DdpJobError(f"{where} = {text!r} has an unknown prefix {prefix!r}: only min: or max:", example)
    if not name or split not in splits:
        which = " or ".join(f"{s}/NAME" for s in splits)
        raise DdpJobError(f"{where} = {text!r} is not a metric this can rank by: expected {which}", example)
    minimize = prefix == "min" if sep else name.endswith(COSTS)
    return Metric(key, minimize, said=bool(sep))
