"""The one guard for secrets: a credential never goes into a config, nor into a shell line ddpjob writes.

A resolved config is written in plain text to ``config.yaml``, the batch script, every checkpoint and every
tracker's params, and a host file's ``setup:`` line runs on the login node; so every way a secret could get there
is refused here, in one line naming the key and where the secret belongs (the job's environment):

- ``${oc.env:NAME}`` of a secret-looking NAME, in any spacing or quoting OmegaConf reads (``${ oc.env : 'NAME' }``,
  a default after a comma, the old ``${env:NAME}``), or with a name that is itself computed (``${oc.env:${x}}``):
  ``refuse_env_interpolation``, on the text as YAML decoded it (a ``\\u`` escape spells nothing new);
- the value of a secret-looking environment variable anywhere in the resolved config, however it got there (a
  resolver this guard does not know): ``validate_secrets``, the backstop;
- credentials in a URL-valued key (``scheme://user:pass@host``, ``?password=``): ``url_credentials``, which
  ``checkpoint.dir``'s own check uses too;
- a literal assignment of a secret-looking variable in ``slurm.setup`` or the host file's ``setup:``
  (``export WANDB_API_KEY=...``): ``refuse_secret_assignments``. Reading it from a file only the user can read
  (``export HF_TOKEN=$(cat ~/.hf_token)``) or from the environment stays allowed.

A secret-looking name: one with KEY, TOKEN, SECRET, PASSWORD, PASSWD or CREDENTIAL in it (``WANDB_API_KEY``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``MLFLOW_TRACKING_PASSWORD``, ``HF_TOKEN``, ...), but not a
tokenizer's (``TOKENIZERS_PARALLELISM``, ``TOKENIZER_DIR``: ML configs name those).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterator
from urllib.parse import parse_qsl, urlsplit

from ddp_core.errors import DdpJobError

_SECRET_NAME = re.compile(r"KEY|TOKEN(?!IZ)|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)  # not TOKENIZER_DIR
# The start of an env resolver's call, however it is spaced: its argument is read by _env_argument.
_ENV_CALL = re.compile(r"\$\{\s*(?:oc\.env|env)\s*:\s*")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# NAME=VALUE at the start of a shell word (export NAME=..., NAME=... cmd, declare -x NAME=...), or csh's setenv.
_ASSIGNMENT = re.compile(r"(?:^|[\s;&|(`])([A-Za-z_][A-Za-z0-9_]*)=(\S*)|\bsetenv\s+([A-Za-z_][A-Za-z0-9_]*)\s+(\S+)")
_MIN_VALUE = 8  # shorter environment values ("1", "true") would match by chance


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def env_hint(name: str) -> str:
    return (
        f"set {name} in the job's environment, not the config (sbatch passes the submitting shell's environment; "
        "wandb, the AWS tools and MLflow read their variables themselves)"
    )


def _env_argument(text: str, start: int) -> str:
    """The variable name of the env resolver whose argument starts at ``start``, quotes and spaces stripped."""
    arg = re.match(r"""\s*(['"]?)([^,}'"]*)""", text[start:])
    assert arg is not None  # the pattern matches the empty string
    return arg[2].strip()


def refuse_env_interpolation(where: str, value: Any) -> None:
    """Refuse ``${oc.env:NAME}`` of a secret-looking or computed NAME anywhere in ``value`` (a string, or the
    mappings and lists YAML read), naming ``where`` (a file, an override)."""
    for text in _texts(value):
        for call in _ENV_CALL.finditer(text):
            name = _env_argument(text, call.end())
            if "$" in name:
                raise DdpJobError(
                    f"{where} interpolates an environment variable whose name is itself interpolated: it could "
                    "read a secret into the config",
                    "write the variable's name out, e.g. ${oc.env:HOME}",
                )
            if is_secret_name(name):
                raise DdpJobError(
                    f"{where} interpolates ${{oc.env:{name}}}, which looks like a secret: its value would be written "
                    "in plain text to config.yaml, checkpoints and the W&B run",
                    f"leave {name} in the environment (wandb reads WANDB_API_KEY itself; sbatch passes the submitting "
                    "shell's environment to the job)",
                )


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _texts(key)
            yield from _texts(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


def strings(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value) of every string in a config tree: dataclasses, task arguments, lists."""
    if dataclasses.is_dataclass(node):
        items = [(f"{prefix}{f.name}", getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, dict):
        items = [(f"{prefix}{name}", value) for name, value in node.items()]
    elif isinstance(node, (list, tuple)):
        items = [(f"{prefix[:-1]}[{i}]", value) for i, value in enumerate(node)]
    else:
        return
    for key, value in items:
        if isinstance(value, str):
            yield key, value
        else:
            yield from strings(value, f"{key}.")


def url_credentials(value: str) -> bool:
    """Whether a URL carries credentials: a user (``user:pass@``) or a secret-looking query parameter."""
    if not _URL.match(value):
        return False
    try:
        parts = urlsplit(value)
    except ValueError:
        return "@" in value
    return "@" in parts.netloc or any(is_secret_name(k) for k, _ in parse_qsl(parts.query, keep_blank_values=True))


def refuse_secret_assignments(where: str, line: str) -> None:
    """Refuse a shell line (``slurm.setup``, the host file's ``setup:``) that assigns a literal value to a
    secret-looking variable; an expansion (``$(cat FILE)``, ``$OTHER``) or an empty value is allowed."""
    for found in _ASSIGNMENT.finditer(line):
        name, value = (found[1], found[2]) if found[1] else (found[3], found[4])
        if is_secret_name(name) and value.lstrip("\"'")[:1] not in ("$", ""):
            raise DdpJobError(
                f"{where} sets {name} to a value written out: the line is saved in plain text (the batch script, "
                "config.yaml) and shown by ps",
                f"{env_hint(name)}; or read it from a file only you can read: export {name}=$(cat ~/.{name.lower()})",
            )


def validate_secrets(cfg: Any) -> None:
    """Every string of a resolved config (``Config``): no URL with credentials, no secret-looking variable's value,
    and no literal secret assignment in ``slurm.setup``. One ``DdpJobError`` naming the key."""
    values = {name: value for name, value in os.environ.items() if is_secret_name(name) and len(value) >= _MIN_VALUE}
    for key, text in strings(cfg):
        if url_credentials(text):
            raise DdpJobError(
                f"config key '{key}' has credentials in its URL (a user, a password or a token): the config is "
                "saved in plain text (config.yaml, checkpoints, the trackers' params)",
                f"drop them from {key}; give them in the job's environment (MLFLOW_TRACKING_USERNAME/PASSWORD, "
                "AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.pgpass)",
            )
        for name, secret in values.items():
            if secret in text:
                raise DdpJobError(
                    f"config key '{key}' holds the value of ${name}: the config is saved in plain text",
                    env_hint(name),
                )
    for i, line in enumerate(cfg.slurm.setup):
        refuse_secret_assignments(f"config key 'slurm.setup[{i}]'", line)
