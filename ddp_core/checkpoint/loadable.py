"""A checkpoint's state must load with ``torch.load(weights_only=True)`` (``store.load``: a checkpoint never runs
code): checked at the first save of each attempt, not found at resume.

``torch.save`` writes anything it can pickle, so a task whose state holds, say, ``np.random.get_state()`` (a numpy
array) writes checkpoints that all verify, while the older ones are pruned, and that ``weights_only`` loading then
refuses: no checkpoint of the run can be resumed. ``refusal`` round-trips the state through torch's own
``weights_only`` unpickler in memory, with every tensor replaced by an empty one of its dtype (so the cost does not
grow with the model), and names the first key it refuses; ``check_first_save`` is rank 0's check, told to every
rank, so they all stop with the same ``DdpJobError``.
"""

from __future__ import annotations

import io
import re
from typing import Any, Optional

import torch

from ddp_core.distributed import collectives
from ddp_core.errors import DdpJobError

HINT = (
    "a checkpoint must load with torch.load(weights_only=True): convert the value to a tensor or to plain lists, "
    "numbers and strings (numpy: torch.from_numpy(a) or a.tolist()) in the state_dict that returns it"
)
_CONTAINERS = (dict, list, tuple)  # rebuilt with empty tensors; any other type is pickled as it is


def _skeleton(value: Any) -> Any:
    """``value`` with every tensor replaced by an empty tensor of its dtype, containers of the exact built-in types
    rebuilt around them."""
    if isinstance(value, torch.Tensor):
        return torch.empty(0, dtype=value.dtype)
    if type(value) is dict:
        return {k: _skeleton(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value


def _refused(value: Any) -> Optional[str]:
    """Why ``weights_only`` loading refuses ``value`` once saved; None if it loads."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as err:  # an UnpicklingError, or a value torch.save cannot pickle at all
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        return f"it needs {found[1]}" if found else f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return None


def _first_refused(value: Any, key: str) -> tuple[str, Any, str]:
    """(the key path, the value, why) of the innermost part of ``value`` (itself refused) that is refused."""
    if type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for name, item in items:
            if _refused(item) is not None:
                return _first_refused(item, f"{key}[{name!r}]")
    return key, value, _refused(value) or "refused"


def refusal(state: dict[str, Any], what: str = "checkpoint state") -> Optional[str]:
    """One line naming the first key of ``state`` that ``weights_only`` loading would refuse; None if all load."""
    skeleton = _skeleton(state)
    if _refused(skeleton) is None:
        return None
    key, value, why = _first_refused(skeleton, "")
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    return f"{what}{key}: {kind} is not loadable with weights_only ({why})"


def check_first_save(state: Optional[dict[str, Any]]) -> None:
    """Collective: rank 0's ``state`` (None elsewhere) is checked; every rank raises the same ``DdpJobError`` if it
    would not load."""
    found = refusal(state) if state is not None else None
    problem = next((p for p in collectives.gather_to_all(found) if p is not None), None)
    if problem is not None:
        raise DdpJobError(problem, HINT)
