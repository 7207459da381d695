"""Real filesystems that fail the way shared ones do, for the tests of what a full disk does to a run.

``small_tmpfs`` mounts a tmpfs of a given size (root only, as the suite runs: the test is skipped otherwise) and
unmounts it after; ``fill`` takes its free space down to a given number of bytes with a file of its own, so the next
write that needs more fails with ENOSPC from the kernel, at the point the test chose. Nothing is faked: the code
under test gets the errors a full filesystem gives.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

PAGE = 4096  # tmpfs allocates in pages: a file of n bytes takes ceil(n / PAGE) of them


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted on ``folder`` (created) for the block."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the suite runs as root here and in CI)")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def fill(folder: Path, leave: int = 0, name: str = ".filler") -> Path:
    """Fill ``folder``'s filesystem so that ``leave`` bytes (rounded up to whole pages) stay free; returns the filler
    file (remove it to give the space back)."""
    pages = -(-leave // PAGE)
    path = folder / name
    with open(path, "ab") as f:
        f.write(b"\0" * (free_bytes(folder) - pages * PAGE))
    assert free_bytes(folder) == pages * PAGE, (free_bytes(folder), pages * PAGE)
    return path


def pages(size: int) -> int:
    """The bytes a file of ``size`` bytes takes on a tmpfs."""
    return -(-size // PAGE) * PAGE
