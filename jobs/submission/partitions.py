"""What the cluster can give: partition sizes read from ``sinfo``, and the container image (``check_image``). A job's
request is checked against them (``jobs.submission.request.SlurmRequest.check_fits``), so an impossible job fails on
the login node instead of pending forever; the doctor reads the same partitions (``jobs.doctor.findings``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ddp_core.cluster.slurm import GATEWAY, MISSING, SlurmGateway
from ddp_core.config.container import ContainerConfig
from ddp_core.errors import DdpJobError


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    cpus_per_node: int  # the largest node's CPUs
    gpus_per_node: int  # the largest node's GPUs
    default: bool = False


def _gpus(gres: str) -> int:
    # "gpu:4", "gpu:a100:4(S:0-1)", "gpu:a100:4,shard:8" or "(null)"
    total = 0
    for item in gres.split(","):
        match = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if match:
            total = max(total, int(match[1]))
    return total


def parse_sinfo(text: str) -> list[Partition]:
    """Lines of ``sinfo -h -o '%P|%D|%c|%G'`` (``slurm.SINFO_FORMAT``) → one ``Partition`` each (node groups merged)."""
    merged: dict[str, Partition] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, nodes, cpus, gres = line.split("|")
        default = name.endswith("*")
        name = name.rstrip("*")
        part = Partition(name, int(nodes), int(cpus.rstrip("+")), _gpus(gres), default)
        if name in merged:
            old = merged[name]
            part = Partition(
                name,
                old.nodes + part.nodes,
                max(old.cpus_per_node, part.cpus_per_node),
                max(old.gpus_per_node, part.gpus_per_node),
                old.default or default,
            )
        merged[name] = part
    return list(merged.values())


def query_partitions(gateway: SlurmGateway = GATEWAY) -> list[Partition]:
    proc = gateway.partitions()
    if proc.returncode == MISSING:
        raise DdpJobError(
            "Slurm commands (sinfo, sbatch) are not on PATH",
            "run on a Slurm login node, start the local cluster with scripts/slurm-local up, or use --local",
        )
    if proc.returncode != 0:
        raise DdpJobError(f"sinfo failed: {proc.stderr.strip()}", "is slurmctld up? (scripts/slurm-local status)")
    return parse_sinfo(proc.stdout)


def pick_partition(partitions: list[Partition], name: Optional[str]) -> Partition:
    for part in partitions:
        if (name is None and part.default) or part.name == name:
            return part
    names = ", ".join(p.name for p in partitions) or "none"
    if name is None:
        raise DdpJobError("the cluster has no default partition", f"set slurm.partition to one of: {names}")
    raise DdpJobError(f"config key 'slurm.partition' = {name!r}: no such partition", f"available: {names}")


def check_image(container: ContainerConfig) -> None:
    """Refuse, in one line, an image the job could not start from: an apptainer image (or a pyxis image given as a
    path) that is not a readable file here. The login node sees the shared filesystems the nodes see."""
    image = container.image
    if image is None or not container.image_is_file:
        return  # no container, or a registry reference that only pyxis on the node can resolve
    path = Path(image)
    if not path.is_file():
        what = "is a directory, not an image file" if path.is_dir() else "does not exist"
        raise DdpJobError(
            f"config key 'slurm.container.image' = {image!r} {what}",
            "build or copy the image there (a path every node sees; scripts/container-image builds the test image), "
            "or set slurm.container.image to it",
        )
