"""``ddpjob doctor``'s findings about the site: the controller's Slurm release with what it does that matters to
ddpjob (``ddp_core.cluster.releases``), and what a compute node of the partition has: ``scontrol`` (a job requeues
itself), ``sacct`` (a lost node is counted) and a container runtime (apptainer, singularity, enroot with pyxis).

The nodes are asked by one tiny step on the partition (``srun`` through the gateway). A partition that cannot give a
node within ``PROBE_WAIT_S`` (busy, drained) does not hold the doctor: the findings say it could not check. The probe
takes a command prefix (a container's exec line, ``apptainer exec IMAGE``), so what a containerised job would find
is asked the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ddp_core.cluster import releases
from ddp_core.cluster.slurm import SlurmGateway
from jobs.doctor.findings import Finding, Level

PROBE_WAIT_S = 20  # srun --immediate: how long the partition may take to give the probe a node
RUNTIMES = ("apptainer", "singularity", "enroot")
PROBED = ("scontrol", "sacct", *RUNTIMES)
# One line per command, "NAME=PATH" (PATH empty when missing), after the node's name: sh only, no other tool.
PROBE_SCRIPT = 'echo "node=$(hostname)"; for c in ' + " ".join(PROBED) + '; do echo "$c=$(command -v "$c")"; done'


@dataclass(frozen=True)
class NodeProbe:
    """What one compute node of a partition has; ``error`` says why it could not be asked (then nothing is known)."""

    partition: str
    node: str = ""
    paths: tuple[tuple[str, str], ...] = ()  # (command, its path there, "" when missing)
    pyxis: bool = False  # srun takes --container-image (the pyxis plugin: enroot containers through srun)
    error: Optional[str] = None
    inside: str = ""  # the image the probe ran in (a run's slurm.container), "" on the node itself

    def path(self, command: str) -> str:
        return dict(self.paths).get(command, "")


def probe_nodes(
    gateway: SlurmGateway, partition: str, prefix: Sequence[str] = (), wait_s: int = PROBE_WAIT_S
) -> NodeProbe:
    """Ask one node of ``partition`` which of ``PROBED`` it has, inside ``prefix`` when given."""
    pyxis = "--container-image" in gateway.srun_help()
    proc = gateway.run_on_node(partition, [*prefix, "sh", "-c", PROBE_SCRIPT], wait_s)
    pairs = dict(line.partition("=")[::2] for line in proc.stdout.splitlines() if "=" in line)
    if proc.returncode != 0 or "node" not in pairs:
        said = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        return NodeProbe(partition, pyxis=pyxis, error=said[-1] if said else f"srun exited {proc.returncode}")
    found = tuple((c, pairs.get(c, "").strip()) for c in PROBED)
    return NodeProbe(partition, pairs["node"], found, pyxis, inside=prefix[-1] if prefix else "")


def node_findings(probe: NodeProbe) -> list[Finding]:
    """scontrol_on_nodes, sacct_on_nodes and container_runtime, each with what it means for a run."""
    if probe.error is not None:
        why = f"could not check the compute nodes of {probe.partition} ({probe.error})"
        fix = "run `ddpjob doctor` again when the partition has a free node, or `ddpjob doctor --drill`"
        return [Finding(k, "unknown", why, fix) for k in ("scontrol_on_nodes", "sacct_on_nodes", "container_runtime")]
    where = f"on {probe.node} ({probe.partition})" + (f" inside {probe.inside}" if probe.inside else "")
    if probe.path("scontrol"):
        scontrol = Finding("scontrol_on_nodes", "ok", f"scontrol {where}: rank 0 requeues its own job", value=True)
    else:
        why = f"no scontrol {where}: the job requeues itself from the batch script instead"
        scontrol = Finding("scontrol_on_nodes", "info", why, value=False)
    if probe.path("sacct"):
        sacct = Finding("sacct_on_nodes", "ok", f"sacct {where}: a lost node is counted at the next start", value=True)
    else:
        why = f"no sacct {where}: a node lost mid-attempt is not counted against slurm.max_failures"
        sacct = Finding("sacct_on_nodes", "info", why, value=False)
    found = [c for c in RUNTIMES if probe.path(c)] + ["pyxis"] * probe.pyxis
    listed = ", ".join(f"{c} ({probe.path(c)})" if probe.path(c) else "srun --container-image (pyxis)" for c in found)
    runtime = Finding("container_runtime", "info", f"container runtimes {where}: {listed or 'none'}", value=found)
    return [scontrol, sacct, runtime]


def release_findings(version: str) -> list[Finding]:
    """slurm_release (tested, between tested ones, untested) and one ``release_KEY`` per known behaviour."""
    support, text = releases.support(version)
    levels: dict[str, Level] = {"tested": "ok", "between": "info"}
    fix = "`ddpjob doctor --drill` interrupts a real job the ways Slurm does" if support == "untested" else ""
    out = [Finding("slurm_release", levels.get(support, "warn"), text, fix, value=version)]
    for fact in releases.facts_for(version):
        what = f"Slurm {version}: {fact.text}" + (f"; {fact.handled}" if fact.handled else "")
        out.append(Finding(f"release_{fact.key}", fact.level, what, value=fact.key))
    return out


def site_findings(gateway: SlurmGateway, partition: str, version: str, image: Optional[str] = None) -> list[Finding]:
    """The release's findings and the compute nodes' (inside ``image``, a run's apptainer image, when given: there
    the ranks look for scontrol)."""
    prefix = ("apptainer", "exec", image) if image else ()
    return [*release_findings(version or gateway.version()), *node_findings(probe_nodes(gateway, partition, prefix))]
