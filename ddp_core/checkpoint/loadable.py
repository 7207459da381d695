"""A checkpoint's state must load with ``torch.load(weights_only=True)`` (``store.load``: a checkpoint never runs
code): checked at the first save of each attempt, not found at resume.

``torch.save`` writes anything it can pickle, so a task whose state holds, say, ``np.random.get_state()`` (a numpy
array) writes checkpoints that all verify, while the older ones are pruned, and that ``weights_only`` loading then
refuses: no checkpoint of the run can be resumed. ``refusal`` round-trips the state through torch's own
``weights_only`` unpickler in memory, with every tensor replaced by an empty one of its dtype (so the cost does not
grow with the model), and names the first key it refuses; ``check_first_save`` is rank 0's check, told to every
rank, so they all stop with the same ``DdpJobError``.

``load`` is the one way ddpjob reads a checkpoint's pickled state (durable, sharded extras, node-local copies and
replicas): ``weights_only`` on the CPU, and refused in one line on a torch older than 2.6, whose ``weights_only``
loading a crafted file could make run code (CVE-2025-32434).
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import IO, Any, Optional, Union

import torch

from ddp_core.distributed import collectives
from ddp_core.errors import DdpJobError

HINT = (
    "a checkpoint must load with torch.load(weights_only=True): convert the value to a tensor or to plain lists, "
    "numbers and strings (numpy: torch.from_numpy(a) or a.tolist()) in the state_dict that returns it"
)
_CONTAINERS = (dict, list, tuple)  # rebuilt with empty tensors; any other type is pickled as it is
SAFE_TORCH = (2, 6)  # the first torch whose weights_only loading cannot be made to run code (CVE-2025-32434)


def require_safe_torch(version: Optional[str] = None) -> None:
    """Refuse, in one line, a torch (this one: ``version`` None) whose ``torch.load(weights_only=True)`` a planted
    file could make run code."""
    version = str(torch.__version__) if version is None else version
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is not None and (int(found[1]), int(found[2])) < SAFE_TORCH:
        raise DdpJobError(
            f"torch {version} can be made to run code while loading a checkpoint (CVE-2025-32434): "
            "ddpjob loads checkpoints only with torch 2.6 or newer",
            "install torch>=2.6 (scripts/setup; on a GPU cluster DDPJOB_TORCH names your site's build)",
        )


def load(source: Union[str, Path, IO[bytes]]) -> Any:
    """A checkpoint's pickled state, read with ``weights_only`` onto the CPU: it can never run code."""
    require_safe_torch()
    return torch.load(source, map_location="cpu", weights_only=True)


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
