"""What a location string names: a local path or object storage (``is_url``), the one test every reader of
``checkpoint.dir`` applies (the config check, the run directory, the storage layer, ``export``).

Imports nothing: the run directory, which login-node readers import, stays stdlib-only at import."""

from __future__ import annotations


def is_url(location: object) -> bool:
    """Whether ``location`` (``checkpoint.dir``, or a path or URL derived from it) names object storage: a URL with a
    scheme other than file://."""
    return isinstance(location, str) and "://" in location and not location.startswith("file://")
