"""How a config check refuses a value: one ``DdpJobError`` naming the key, the value, why, and where to fix it."""

from __future__ import annotations

from typing import Any

from ddp_core.errors import DdpJobError


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """Raise ``DdpJobError`` for ``key`` = ``value`` unless ``ok``: ``why`` says what it must be."""
    if not ok:
        raise DdpJobError(f"config key '{key}' = {value!r} is invalid: {why}", f"fix it in the YAML or with {key}=...")
