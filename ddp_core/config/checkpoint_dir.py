"""The login node's checks of ``checkpoint.dir`` that need no network: the value's form (an absolute path, or a
storage URL with no credentials in it), and that the built-in trainer is the one writing checkpoints. That the
bucket exists and takes a test object is checked before submitting (``ddp_core.checkpoint.storage.probe``, from
``jobs.submission.checks``)."""

from __future__ import annotations

import re
from typing import Optional
from urllib.parse import urlsplit

from ddp_core.config.problems import require
from ddp_core.config.secrets import url_credentials
from ddp_core.locations import is_url

_KEY = "checkpoint.dir"
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


def validate_checkpoint_dir(value: Optional[str], script_enabled: bool) -> None:
    """Raise ``DdpJobError`` naming ``checkpoint.dir`` for a value the login node can tell is wrong."""
    if value is None:
        return
    require(bool(value.strip()) and value == value.strip(), _KEY, value, "a path or a URL, no surrounding spaces")
    require(not any(ord(c) < 32 or ord(c) == 127 for c in value), _KEY, value, "no control characters")
    require(
        not script_enabled,
        _KEY,
        value,
        "script mode's script writes its own checkpoints (runtime.checkpoint_dir(), in the run directory)",
    )
    if not is_url(value):
        path = value.removeprefix("file://")
        require(path.startswith("/"), _KEY, value, "a local path must be absolute (the nodes start elsewhere)")
        require(".." not in path.split("/"), _KEY, value, "no '..' in it: name the folder itself")
        return
    parts = urlsplit(value)
    require(bool(_SCHEME.match(parts.scheme)), _KEY, value, "the URL's scheme must be a plain name, e.g. s3")
    # Credentials never go into the config (config.yaml, the sbatch script and the logs would carry them).
    require(
        not url_credentials(value) and not parts.query and not parts.fragment,
        _KEY,
        "<a URL with credentials or options>",
        "no user, password, query or fragment in the URL: credentials come from the AWS environment "
        "(AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, an instance role)",
    )
    require(bool(parts.netloc), _KEY, value, "the URL names no bucket, e.g. s3://BUCKET/PREFIX")
