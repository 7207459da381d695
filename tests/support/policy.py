"""A fabricated Slurm for the after-failure policy's unit tests (``ddp_core.cluster.policy``): a gateway whose runner
answers for job 57 in partition ``local``, the run directory the policy records in, and one call of the policy."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.failures import Failure, Kind
from ddp_core.cluster.policy import Decision, decide_after
from ddp_core.cluster.slurm import SlurmGateway
from ddp_core.config import load_config, to_yaml
from ddp_core.run.rundir import RunDir


class Slurm:
    """A gateway over a fabricated cluster: job 57 runs in partition ``local`` (``nodes``), whose nodes are in
    ``states`` (MIXED where it names none); every call is kept."""

    def __init__(self, nodes: str = "n[1-3]", states: dict[str, str] | None = None) -> None:
        self.nodes, self.states = nodes, states or {}  # states: a node's State (default MIXED), as scontrol says
        self.calls: list[tuple[str, ...]] = []
        self.gateway = SlurmGateway(self.answer)

    def answer(self, cmd: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        self.calls.append(tuple(cmd))
        out = ""
        if cmd[:3] == ("scontrol", "show", "job"):
            out = f"JobId={cmd[-1]} JobState=RUNNING Partition=local Restarts=0\n"
        elif cmd[:3] == ("scontrol", "show", "node"):
            state = self.states.get(cmd[-1], "MIXED")
            reason = " Reason=bad DIMM [admin@2026-12-02T01:00:00]" if "DRAIN" in state else ""
            out = f"NodeName={cmd[-1]} Arch=x86_64 State={state} Partitions=local{reason}\n"
        elif cmd[:3] == ("scontrol", "show", "partition"):
            out = f"PartitionName=local Nodes={self.nodes} TotalNodes=3\n"
        elif cmd[0] == "sacct" and "JobID,State,MaxRSS,ReqMem" in cmd:  # as the site profile's sacct wrote it
            out = "57|FAILED||308M\n57.batch|FAILED|0|\n57.0|OUT_OF_MEMORY|154004K|\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    def asked(self) -> list[tuple[str, ...]]:
        """The calls that changed the job: requeues and exclusions."""
        return [c for c in self.calls if c[:2] in (("scontrol", "requeue"), ("scontrol", "update"))]


def run_dir(tmp_path: Path, *overrides: str) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.path.mkdir(parents=True)
    run.config_file.write_text(to_yaml(load_config(None, ["run.name=t", *overrides])))
    return run


def failure_event(job: str, host: str, kind: str = "infrastructure") -> dict[str, object]:
    return {"job_id": job, "restart_count": 0, "kind": kind, "rank": 1, "host": host, "step": 10, "error": "x"}


KILLED = Failure(Kind.infrastructure, 1, "n2", 40, "killed by a signal (Killed)")
ENV = DistEnv(job_id="57", slurm_job_id="57", restart_count=0)


def decide(run: RunDir, slurm: Slurm, failure: Failure = KILLED, **kw: Any) -> Decision:
    job = slurm.gateway.show_job("57")
    return decide_after(failure, run, ENV, slurm.gateway, run.load_config().slurm, job=job, **kw)


def events(run: RunDir) -> list[tuple[str, object]]:
    return [(e["event"], e.get("host") or e.get("kind")) for e in run.events()]
