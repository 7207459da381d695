"""The project's one user-facing exception: a message that names the problem and a hint that says the fix."""

from __future__ import annotations


class DdpJobError(Exception):
    """A user error (bad config, impossible request, unusable run directory).

    The CLI prints ``str(err)`` as one line and exits non-zero; tracebacks are for bugs only.
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message
