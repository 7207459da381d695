"""What the cluster can give: partition sizes read from ``sinfo``, and the container image
(``check_image``). A job's request is checked against them
(``jobs.request.SlurmRequest.check_fits``), so an impossible job fails on the login node instead of pending forever;
``node_count_finding`` is the doctor's view of a run's node count (or range) against its partition."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ddp_core.cluster.slurm import GATEWAY, MISSING, SlurmGateway
from ddp_core.config.container import ContainerConfig
from ddp_core.errors import DdpJobError
from jobs.findings import Finding


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


def node_count_finding(nodes: Any, min_nodes: int, max_nodes: int, partition: str, total: int) -> Finding:
    """``slurm.nodes`` (a count, or an elastic MIN-MAX) against the ``total`` nodes of ``partition``. A MIN the
    partition cannot give pends forever: a problem. A MAX above it is reached never: a warning (Slurm starts the job
    on what there is, as ``check_fits`` warns at submit)."""
    if total <= 0:
        return Finding("nodes", "unknown", f"slurm.nodes={nodes}: partition {partition} does not say its node count")
    where = f"partition {partition} has {total} nodes"
    if min_nodes > total:
        fix = f"set slurm.nodes<={total}" + (f" (a range: MIN<={total})" if min_nodes != max_nodes else "")
        return Finding("nodes", "problem", f"slurm.nodes={nodes}: {where}, the job needs {min_nodes}", fix, nodes)
    if max_nodes > total:
        why = f"slurm.nodes={nodes}: {where}, so attempts run on at most {total} (MAX {max_nodes} is never reached)"
        return Finding("nodes", "warn", why, f"set slurm.nodes={min_nodes}-{total}", nodes)
    if min_nodes != max_nodes:
        why = f"slurm.nodes={nodes}: each attempt starts on {min_nodes} to {max_nodes} nodes, as many as are free "
        why += f"({where})"
        return Finding("nodes", "info", why, value=nodes)
    return Finding("nodes", "ok", f"slurm.nodes={nodes}: {where}", value=nodes)


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
