"""A site's limits on what a user may queue, in one place: what sbatch's refusal by an association or a QOS means
(``refusal``: one line naming the limit, and the fix), and how many more jobs the user may queue now (``room``,
before a sweep submits arrays whose every task counts as a job: ``check_room``). ``ddpjob doctor`` reads the same
limits (``submit_limit``).

sbatch names the limit it enforced in a word of Slurm's (``QOSMaxSubmitJobPerUserLimit``, ``AssocGrpCpuLimit``,
``QOSMaxWallDurationPerJobLimit``, ...), then ``Batch job submission failed: Job violates accounting/QOS policy``;
a user or account without an association gets ``Invalid account or account/partition combination specified``.
"""

from __future__ import annotations

import getpass
import re
from typing import Optional, Sequence

from ddp_core.cluster.slurm import GATEWAY, SlurmGateway
from ddp_core.errors import DdpJobError

LIMIT = re.compile(r"\b(QOS|Assoc)(Grp|Max)(\w+?)(PerUser|PerAccount|PerJob|PerNode|MinsPerJob)?Limit\b")
QOS_FIELDS = ("Name", "MaxSubmitPU")
ASSOC_FIELDS = ("Partition", "DefaultQOS", "MaxSubmit", "GrpSubmit")  # job_qos, submit_limit (and the doctor)
MINE = "sacctmgr show assoc user=$USER format=account,partition,qos,maxsubmit"
ASK_LESS = "ask for less (slurm.nodes, slurm.tasks_per_node, slurm.cpus_per_task, slurm.gpus_per_node, slurm.mem_gb)"


def _fix(what: str) -> str:
    if what.startswith("SubmitJob"):
        return (
            "as many of your jobs are queued as it allows: wait for some to end (squeue --me), or use a QOS "
            "with more room (slurm.qos)"
        )
    if what.startswith("Job"):
        return "as many of your jobs run as it allows: this one waits in the queue; a QOS with more room: slurm.qos"
    if what.startswith("Wall"):
        return "ask for less time (slurm.time_min), or use a QOS that allows more (slurm.qos)"
    return f"{ASK_LESS}, or use a QOS that allows more (slurm.qos)"


def refusal(text: str) -> Optional[tuple[str, str]]:
    """(one line naming the limit, the fix) for sbatch's answer ``text`` when an association or QOS refused the job;
    None for any other refusal."""
    if found := LIMIT.search(text):
        owner, kind, what, per = found.group(1), found.group(2), found.group(3), found.group(4) or ""
        owner = "your association" if owner == "Assoc" else "the QOS"
        return f"sbatch refused the job: {owner}'s {kind}{what}{per} limit ({found.group(0)})", _fix(what)
    if "Invalid account or account/partition combination" in text:
        return (
            "sbatch refused the job: you have no association with that account and partition (Invalid account)",
            f"set slurm.account (and slurm.partition) to one of yours: {MINE}",
        )
    if "Invalid qos specification" in text:
        return "sbatch refused the job: your association does not allow that QOS", f"set slurm.qos to one of: {MINE}"
    if "violates accounting/QOS policy" in text:
        return "sbatch refused the job: a limit of your association or QOS", f"ddpjob doctor lists them; {MINE}"
    return None


def job_qos(assoc: Sequence[dict[str, str]], qos: Optional[str]) -> str:
    """The QOS a job runs under: ``slurm.qos``, else the user's default, else Slurm's own default."""
    defaults = [a["DefaultQOS"] for a in assoc if a.get("DefaultQOS")]
    return qos or (defaults[0] if defaults else "normal")


def submit_limit(
    qos: Sequence[dict[str, str]], assoc: Sequence[dict[str, str]], qos_name: str, partition: str
) -> Optional[tuple[int, str]]:
    """The fewest jobs the user may have queued or running (each array task counts), and which limit says so."""
    limits = {f"QOS {qos_name} MaxSubmitPU": q.get("MaxSubmitPU", "") for q in qos if q["Name"] == qos_name}
    for a in (a for a in assoc if a.get("Partition") in ("", partition)):
        limits |= {"association MaxSubmit": a.get("MaxSubmit", ""), "association GrpSubmit": a.get("GrpSubmit", "")}
    numbers = {source: int(v) for source, v in limits.items() if v.isdigit()}
    return min(((n, s) for s, n in numbers.items()), default=None)


def room(qos: Optional[str], partition: str, gateway: SlurmGateway = GATEWAY) -> Optional[tuple[int, int, str]]:
    """(the submit limit, the user's jobs queued or running now, the limit's source); None where no limit applies or
    accounting does not answer (sbatch is then the judge)."""
    qos_rows = gateway.qos_records(QOS_FIELDS)
    assoc = gateway.associations(getpass.getuser(), ASSOC_FIELDS)
    if qos_rows is None or assoc is None:
        return None
    found = submit_limit(qos_rows, assoc, job_qos(assoc, qos), partition)
    if found is None:
        return None
    proc = gateway.run("squeue", "--me", "-h", "-r", "-o", "%i")
    queued = len(proc.stdout.split()) if proc.returncode == 0 else 0
    return found[0], queued, found[1]


def check_room(count: int, qos: Optional[str], partition: str, gateway: SlurmGateway = GATEWAY) -> None:
    """A sweep of ``count`` new array tasks fits the user's submit limit now, or is refused before anything is
    created, in one line naming the limit."""
    if count == 0 or (found := room(qos, partition, gateway)) is None:
        return
    limit, queued, source = found
    if queued + count > limit:
        left = max(0, limit - queued)
        raise DdpJobError(
            f"the sweep would queue {count} jobs (each trial is one), but {source} allows {limit} queued and "
            f"{queued} are queued now: {left} more fit",
            f"sweep at most {left} trials now (fewer values, or --trials); `ddpjob sweep` again adds the rest once "
            "those end, or use a QOS with more room (slurm.qos)",
        )
