"""The ``slurm.container`` section: every rank of a job runs inside a container image (docs/containers.md).

Owned here, in the torch-free config package, so the schema imports nothing above it. The rendering of the task
command inside the image is ``jobs.submission.request`` (``container_prefix``); the check that the image exists is
``jobs.submission.partitions.check_image``. ``validate_container`` is the shape check every load runs: nothing here
touches the filesystem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

from ddp_core.errors import DdpJobError

RUNTIMES = ("apptainer", "pyxis")
# A bind, as apptainer and pyxis take it: SRC[:DST[:OPTIONS]], both absolute, no spaces, commas or quotes (a comma
# separates binds in both runtimes' own syntax, so it could smuggle in a second one).
_PATH = r"/[^\s,:'\"]*"
_BIND = re.compile(rf"({_PATH})(?::({_PATH}))?(?::(ro|rw))?")
# An image: a path or a reference (pyxis: docker://..., a registry name), never a shell word that needs quoting.
_IMAGE = re.compile(r"[^\s'\"]+")


@dataclass
class ContainerConfig:
    """Where the ranks run: on the nodes themselves (no image, the default), or inside a container image."""

    # The image every rank runs in: a SIF file for apptainer (made absolute at submit: a relative path is taken
    # from where ddpjob runs), or for pyxis what srun --container-image takes (a squashfs file, or a registry
    # reference such as nvcr.io#nvidia/pytorch:24.05-py3). null: no container.
    image: Optional[str] = None
    # Host paths bound into the container besides the run directory, its code snapshot and ddpjob's own code (which
    # are always bound at the same paths): "SRC", "SRC:DST" or "SRC:DST:ro", absolute paths (datasets, caches).
    binds: List[str] = field(default_factory=list)
    # "apptainer": each task runs `apptainer exec IMAGE python ...` (--nv when GPUs are requested); "pyxis": srun's
    # --container-image=IMAGE (NVIDIA's Slurm plugin; rendered, not run on a real pyxis here).
    runtime: str = "apptainer"
    # The interpreter inside the image that runs the ranks; it must have torch and ddpjob's dependencies (ddpjob's own
    # code is bound in from the submitting checkout or installation).
    python: str = "python3"

    @property
    def enabled(self) -> bool:
        return self.image is not None

    @property
    def image_is_file(self) -> bool:
        """Whether ``image`` names a file here (always for apptainer; for pyxis only a path, not a registry
        reference that only pyxis on the node resolves): made absolute at submit and checked to exist."""
        return self.image is not None and (self.runtime == "apptainer" or self.image.startswith(("/", "./", "../")))


def validate_container(container: ContainerConfig) -> None:
    """Shape checks of ``slurm.container`` at every load: one ``DdpJobError`` line naming the key and the fix."""
    if container.runtime not in RUNTIMES:
        raise DdpJobError(
            f"config key 'slurm.container.runtime' = {container.runtime!r} is not a container runtime ddpjob knows",
            f"use one of: {', '.join(RUNTIMES)}",
        )
    if container.image is None:
        if container.binds:
            raise DdpJobError(
                f"config key 'slurm.container.binds' = {container.binds!r} is set without slurm.container.image",
                "set slurm.container.image to the image the ranks run in, or drop the binds",
            )
        return
    if not container.image.strip() or not _IMAGE.fullmatch(container.image):
        raise DdpJobError(
            f"config key 'slurm.container.image' = {container.image!r} is not an image path",
            "set it to the image file (e.g. /shared/images/train.sif), or null to run without a container",
        )
    for bind in container.binds:
        match = _BIND.fullmatch(bind)
        if match is None or any(part in ("..", ".") for part in bind.split(":")[0].split("/")):
            raise DdpJobError(
                f"config key 'slurm.container.binds' has {bind!r}, which is not an absolute bind",
                "write each bind as /host/path, /host/path:/path/inside or /host/path:/path/inside:ro",
            )
    if not container.python.strip() or any(c.isspace() or c in "'\"" for c in container.python):
        raise DdpJobError(
            f"config key 'slurm.container.python' = {container.python!r} is not an interpreter's name",
            "set it to the image's Python, e.g. python3 or /opt/venv/bin/python",
        )
