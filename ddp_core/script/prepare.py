"""The login node's side of script mode: before anything is created, the script of a ``script`` section is checked
and recorded (``resolve_for_submit``: its absolute path, or a module's origin, and its sha256). Torch-free: ``ddpjob``
imports it. (How a sweep's ``script.args.NAME`` keys become the script's arguments is the config's:
``ddp_core.config.features.with_swept_args``.)
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Optional

from ddp_core.config import ScriptConfig
from ddp_core.errors import DdpJobError

SCRIPT_HINT = "give one with `ddpjob submit --script train.py`, or script.path=... / script.module=pkg.train"


def resolve_for_submit(script: ScriptConfig, base: Optional[Path] = None) -> None:
    """Login node, before anything is created: the script exists and is readable here; record its absolute path and
    sha256 in place. A module is looked up (its parent packages are imported) and its file hashed where it has one."""
    if script.path is not None:
        path = ((base or Path.cwd()) / Path(script.path).expanduser()).absolute()
        if not path.exists():
            raise DdpJobError(
                f"config key 'script.path' = {script.path!r}: {path} does not exist",
                "check the path: a relative one is taken from the directory you run ddpjob in",
            )
        if not path.is_file():
            raise DdpJobError(
                f"config key 'script.path' = {script.path!r}: {path} is not a regular file",
                "name the .py file itself, not its directory (or use script.module for a package)",
            )
        script.path = str(path)
        script.sha256 = sha256_of(path, "script.path")
    elif script.module is not None:
        origin = _module_origin(script.module)
        script.sha256 = sha256_of(Path(origin), "script.module") if origin else None


def _module_origin(module: str) -> Optional[str]:

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as err:
        spec, why = None, f" ({type(err).__name__}: {err})"
    else:
        why = ""
    if spec is None:
        raise DdpJobError(
            f"config key 'script.module' = {module!r} cannot be imported here{why}",
            "jobs inherit this environment: install the package or add it to PYTHONPATH",
        )
    return spec.origin if spec.has_location and spec.origin and Path(spec.origin).is_file() else None


def sha256_of(path: Path, key: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as err:
        raise DdpJobError(
            f"config key '{key}': {path} is not readable ({err.strerror or err})",
            "make it readable by you and the job (chmod a+r), or copy it somewhere that is",
        ) from None
    return digest.hexdigest()
