"""A real memory limit outside Slurm's: a cgroup v1 memory controller's group, which a test's task joins at a chosen
point (writing its pid to ``cgroup.procs``), so that the kernel's own OOM killer ends it, as a node whose memory
nothing of Slurm's limits ends a task that takes it all (``ddp_core.cluster.oom_log``)."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Iterator

MEMORY = Path("/sys/fs/cgroup/memory")


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A memory cgroup of ``limit`` bytes for the block; yields its ``cgroup.procs``. Created after the cluster
    started, it is seen by its jobs all the same: a cgroup hierarchy's mount is the kernel's, not a namespace's."""
    import pytest

    if os.geteuid() != 0 or not (MEMORY / "cgroup.procs").exists():
        pytest.skip(
            "a memory cgroup needs root and cgroup v1's memory controller (the suite runs as root here and in CI)"
        )
    group = MEMORY / f"ddpjob-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        yield group / "cgroup.procs"
    finally:
        group.rmdir()  # its processes were killed, or left with the job
