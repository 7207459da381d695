"""What doctor's unit tests fabricate: a cluster's setup as its Slurm commands print it (formats captured from the
local Slurm 22.05 cluster with read-only commands), run directories, and doctor's findings by key."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from ddp_core.cluster import slurm
from jobs.doctor import checks as doctor

# `scontrol show config` (the keys doctor and the gateway read, among a few others, as Slurm prints them)
CONFIG = {
    "AccountingStorageType": "accounting_storage/slurmdbd",
    "ClusterName": "ddpjob",
    "JobRequeue": "1",
    "KillWait": "10 sec",
    "MaxArraySize": "1001",
    "PreemptMode": "REQUEUE",
    "PreemptType": "preempt/partition_prio",
    "PreemptExemptTime": "00:00:00",
    "SlurmctldParameters": "(null)",
    "SLURM_VERSION": "22.05.8",
}
# `scontrol show partition -o low`
LOW = (
    "PartitionName=low AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=30 Hidden=NO MaxNodes=UNLIMITED "
    "MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=n[1-2] PriorityJobFactor=1 PriorityTier=1 "
    "RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=REQUEUE State=UP TotalCPUs=8 "
    "TotalNodes=2 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED "
    "TRES=cpu=8,mem=8000M,node=2,billing=8"
)
# `sacctmgr -n -P show qos format=Name,Preempt,PreemptMode,GraceTime,MaxSubmitPU`
QOS = "normal||cluster|00:00:00|\nlow||requeue|00:00:30|\nhigh|low|cluster|00:00:00|\n"
# `sacctmgr -n -P show assoc where user=... format=Partition,DefaultQOS,MaxSubmit,GrpSubmit`
ASSOC = "|||\n"
# what the node probe prints on a node with scontrol and sacct and no container runtime
PROBED = "node=n1\nscontrol=/usr/bin/scontrol\nsacct=/usr/bin/sacct\napptainer=\nsingularity=\nenroot=\n"


def partition(name: str, **fields: str) -> str:
    """The ``low`` line, renamed, with other values for ``fields``."""
    line = LOW.replace("PartitionName=low", f"PartitionName={name}")
    for key, value in fields.items():
        line = re.sub(rf"(?<= ){key}=\S*", f"{key}={value}", line)
    return line


PARTITIONS = [
    partition("local", Default="YES", GraceTime="0", PreemptMode="OFF"),
    partition("low"),
    partition("low-cancel", PreemptMode="CANCEL"),
    partition("high", PriorityTier="10", GraceTime="0", PreemptMode="OFF"),
]


class FakeSlurm:
    """Answers the read-only commands doctor runs; anything else fails the test."""

    def __init__(
        self,
        partitions: Sequence[str] = tuple(PARTITIONS),
        qos: Optional[str] = QOS,
        assoc: Optional[str] = ASSOC,
        sacct_rc: int = 0,
        node: tuple[int, str, str] = (0, PROBED, ""),
        srun_help: str = "Usage: srun [OPTIONS(0)... [executable(0) [args(0)...]]]",
        **config: str,
    ) -> None:
        merged = CONFIG | config
        self.config = "Configuration data as of 2026-11-22T19:16:58\n" + "".join(
            f"{k:<23} = {v}\n" for k, v in merged.items()
        )
        self.partitions, self.qos, self.assoc, self.sacct_rc = list(partitions), qos, assoc, sacct_rc
        self.node, self.srun_help = node, srun_help  # the node probe's (rc, stdout, stderr); srun --help
        self.calls: list[list[str]] = []

    def __call__(self, cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        cmd = list(cmd)
        self.calls.append(cmd)
        ok = lambda out: subprocess.CompletedProcess(cmd, 0, out, "")  # noqa: E731
        fail = lambda err: subprocess.CompletedProcess(cmd, 1, "", err)  # noqa: E731
        if cmd == ["scontrol", "show", "config"]:
            return ok(self.config)
        if cmd[:4] == ["scontrol", "show", "partition", "-o"]:
            lines = [p for p in self.partitions if len(cmd) == 4 or p.startswith(f"PartitionName={cmd[4]} ")]
            return ok("\n".join(lines) + "\n") if lines else fail(f"Partition {cmd[4]} not found")
        if cmd[:5] == ["sacctmgr", "-n", "-P", "show", "qos"]:
            return ok(self.qos) if self.qos is not None else fail("sacctmgr: error: Problem talking to the database")
        if cmd[:5] == ["sacctmgr", "-n", "-P", "show", "assoc"]:
            return (
                ok(self.assoc) if self.assoc is not None else fail("sacctmgr: error: Problem talking to the database")
            )
        if cmd[0] == "sacct":
            return subprocess.CompletedProcess(cmd, self.sacct_rc, "", "" if not self.sacct_rc else "sacct: error: x")
        if cmd == ["srun", "--help"]:
            return ok(self.srun_help)
        if cmd[0] == "srun":
            return subprocess.CompletedProcess(cmd, *self.node)
        raise AssertionError(f"doctor ran an unexpected command: {cmd}")


def make_run(path: Path, saves: Sequence[float] = (), config: str = "") -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("run:\n  name: t\n" + config)
    lines = [{"step": 10, "time": 1.0, "split": "train", "loss": 1.0}]
    lines += [{"step": 10 * (i + 1), "time": 2.0, "split": "checkpoint", "save_s": s} for i, s in enumerate(saves)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def diagnose(fake: FakeSlurm, partition: Optional[str] = None, run: Optional[Path] = None) -> dict[str, doctor.Finding]:
    findings = doctor.diagnose(slurm.SlurmGateway(fake), partition, run)
    by_key = {f.key: f for f in findings}
    assert len(by_key) == len(findings), "keys are unique"
    assert all(f.level in ("ok", "info", "warn", "problem", "unknown") for f in findings)
    assert all(f.fix for f in findings if f.level == "problem"), "every problem names its fix"
    return by_key
