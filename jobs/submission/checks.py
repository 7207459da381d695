"""Steps 1 and 2 of the submission pipeline, the same for every way in (``submit``, ``resume``, ``prepare`` and the
template, a sweep's arrays, an adaptive search's workers, ``--dry-run``):

1. ``check``: what one run will import (``check_code``: the script, or the task and the strategy's cut of its
   model), the object storage ``checkpoint.dir`` names (``check_storage``: a test object), that the runs'
   filesystem locks across nodes (``check_locks``: its mount options and a real ``flock``), what ``--local``
   allows, the container image's path, and, unless told not to, the cluster (``sinfo``: the partition, and the
   image's file). Every refusal is one line naming the key, before anything is created.
2. ``resolve``: the job's one ``SlurmRequest``, from the checked config and the partition; checked against the
   partition (``SlurmRequest.check_fits``) and recorded in the config (``slurm.cpus_per_task``, which config.yaml
   keeps). The renderers and the submission take the request itself: nothing derives it again.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from ddp_core.config import Config, WandbMode
from ddp_core.config.perf_checks import warn_without_nvml
from ddp_core.config.tracking import check_installed
from ddp_core.errors import DdpJobError
from ddp_core.run.permissions import is_private, tighten
from jobs.submission import partitions
from jobs.submission.request import SlurmRequest


def check_code(cfg: Config) -> None:
    """The code one run will import, checked here, whichever way it is submitted (``submit``, ``resume``, each
    distinct trial of a sweep, a search's base config): the script (it must be there and readable now; its absolute
    path and sha256 are recorded), or the task (its module imported, with torch) and the strategy's cut of its model
    (a meta-device model: fsdp wrap classes, pipeline stages, ties across stages). And each configured tracker's
    package (log.trackers). And the run's permission policy, before anything is created (``ddp_core.run.permissions``:
    never writable by others; private when run.private or DDPJOB_PRIVATE asks)."""
    tighten(is_private(cfg.run.private))
    check_installed(cfg.log, wandb_enabled=cfg.wandb.mode is not WandbMode.disabled)
    if cfg.script.enabled:
        from ddp_core.script.prepare import resolve_for_submit

        resolve_for_submit(cfg.script)
        return
    from ddp_core.strategies.check import check_model
    from ddp_core.tasks.base import check_task

    check_task(cfg.task)
    check_model(cfg)
    warn_without_nvml(cfg.train)  # a warning, not a refusal: the job trains on without GPU telemetry


def check_place(cfg: Config, local: bool = False, cluster: bool = True) -> Optional[partitions.Partition]:
    """Where the run is to go: ``--local`` (one node, no image), the image's path made absolute (the nodes do not
    start where ddpjob ran), and with ``cluster`` the partition (returned, for ``resolve``) and the image's file."""
    if local and cfg.slurm.max_nodes > 1:
        raise DdpJobError(
            f"config key 'slurm.nodes' = {cfg.slurm.nodes!r}: more than one node cannot run with --local",
            "drop --local or set slurm.nodes=1",
        )
    container = cfg.slurm.container
    if local and container.enabled:
        raise DdpJobError(
            f"config key 'slurm.container.image' = {container.image!r}: --local runs the ranks as processes here, "
            "not inside an image",
            "drop --local, or set slurm.container.image=null to run locally without the image",
        )
    if container.image_is_file:
        container.image = str(Path(str(container.image)).absolute())
    if local or not cluster:
        return None
    part = partitions.pick_partition(partitions.query_partitions(), cfg.slurm.partition)
    partitions.check_image(container)
    return part


def check_storage(cfg: Config) -> None:
    """``checkpoint.dir`` in object storage: the bucket exists and takes a test object, with the credentials and
    endpoint the AWS tools find here (the job inherits this environment). A local folder is the nodes' to make."""
    from ddp_core.checkpoint import storage

    if storage.is_url(cfg.checkpoint.dir):
        storage.probe(str(cfg.checkpoint.dir))


def check_locks(cfg: Config) -> None:
    """The runs' filesystem takes a ``flock`` that holds across nodes (``ddp_core.run.locking``): the run
    directory's trainer lock is what keeps two trainers out of one run."""
    from ddp_core.run import locking

    if (why := locking.problem(Path(cfg.run.root))) is not None:
        raise DdpJobError(why, locking.HINT)


def check(cfg: Config, local: bool = False, cluster: bool = True) -> Optional[partitions.Partition]:
    """Step 1 for one run: ``check_code``, ``check_storage``, ``check_locks`` and ``check_place``; the partition when
    the cluster was asked."""
    check_code(cfg)
    check_storage(cfg)
    check_locks(cfg)
    return check_place(cfg, local, cluster)


def check_and_resolve(
    cfg: Config,
    local: bool = False,
    cluster: bool = True,
    run_root: Optional[Path] = None,
    dependency: Optional[str] = None,
) -> SlurmRequest:
    """Steps 1 and 2 for one run (``submit``, ``resume``, ``prepare``, the doctor's drill): its checked request."""
    if dependency and local:
        raise DdpJobError("--after waits for Slurm jobs: it cannot run with --local", "drop --local or --after")
    return resolve(cfg, check(cfg, local, cluster), run_root=run_root, dependency=dependency)


def resolve(
    cfg: Config,
    part: Optional[partitions.Partition] = None,
    python: str = sys.executable,
    run_root: Optional[Path] = None,
    dependency: Optional[str] = None,
) -> SlurmRequest:
    """Step 2: the job's request (``SlurmRequest.resolve``: ``python`` is the submitting interpreter, ``run_root``
    the folder of the run directories a container binds in, ``dependency`` sbatch's --dependency), checked against
    ``part`` when the cluster was asked, and its CPUs per rank recorded in ``cfg`` for config.yaml."""
    request = SlurmRequest.resolve(cfg, part, python=python, run_root=run_root, dependency=dependency)
    if part is not None:
        request.check_fits(part)
    cfg.slurm.cpus_per_task = request.cpus_per_rank
    return request
