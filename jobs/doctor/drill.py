"""``ddpjob doctor --drill``: a fire drill on the real cluster, before a week of allocation depends on it.

A tiny 2-rank job and its uninterrupted twin are submitted to the partition. The drill job is interrupted the
ways Slurm interrupts jobs: the warning signal (``scancel --signal``: the rank 0 of the job must requeue it
itself, so this also proves ``scontrol`` works on compute nodes), ``scontrol requeue`` (SIGTERM, then Slurm
requeues), and, with ``--preempt-from P``, a real preemption by a job in partition P. Each time it must save,
come back as the same job and resume at the step it saved; at the end its weights must equal the twin's.
Timings are measured from the run directory's records (``attempts.jsonl`` and ``metrics.jsonl``, both with
millisecond times). Jobs and run directories are removed afterwards, whatever happened.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ddp_core.cluster.slurm import GATEWAY, SlurmGateway
from ddp_core.config import Config, load_config
from ddp_core.run import private
from ddp_core.run.rundir import RunDir, create_run_dir
from jobs.doctor.findings import Finding

DIGEST = re.compile(r"final weights sha256 ([0-9a-f]{64})")
# Long enough that the job is still training after three interruptions, short enough for a drill.
DRILL_SETTINGS = [
    "run.name=doctor-drill",
    # Paced steps (PacedDigitsTask): three interruptions land mid-run on any hardware, and the drill's two jobs cost
    # the cluster little compute while they wait for them.
    "task.target=ddp_core.tasks.digits:PacedDigitsTask",
    "task.data.pause_s=0.02",
    "train.max_steps=800",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every_steps=100000",
    "data.batch_size=32",
    "wandb.mode=disabled",
    "slurm.nodes=1",
    "slurm.tasks_per_node=2",
    "slurm.time_min=20",
]
WAIT_S = 300  # for any one thing to happen (a requeued job may queue behind others)


@dataclass(frozen=True)
class Timing:
    how: str
    step: Optional[int]  # where the attempt stopped (None: a script that never told runtime a step)
    saved_s: float  # signal -> checkpoint written and recorded
    requeued_s: Optional[float]  # signal -> back in the queue (None: Slurm requeued it itself, unrecorded)
    resumed_s: float  # signal -> first step of the next attempt


class DrillFailed(Exception):
    pass


def _step(event: dict[str, Any]) -> Optional[int]:
    """An event's step; None where it has none: script mode records ``start`` with ``step: null``, and ``completed``
    or ``interrupted`` with null when the script never gave ``runtime.log`` / ``runtime.requeue`` a step."""
    step = event.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _wait(what: str, check: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise DrillFailed(f"timed out after {timeout:.0f} s waiting for {what}")


class Drill:
    def __init__(self, cfg: Config, run: RunDir, job_id: str, gateway: SlurmGateway) -> None:
        self.cfg, self.run, self.job_id, self.gateway = cfg, run, job_id, gateway

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.run.events() if e["event"] == kind]

    def trained_past(self, step: Optional[int]) -> Optional[dict[str, Any]]:
        """The first train record past ``step``; None for ``step``: any (a script's start has no step)."""
        after = -1 if step is None else step
        return next((m for m in self.run.metrics() if m["split"] == "train" and m["step"] > after), None)

    def interrupt(self, how: str, do: Callable[[], None], expect_kind: str) -> Timing:
        n = len(self.events("interrupted"))
        _wait("the job to start", lambda: len(self.events("start")) > n)  # one start per attempt
        starts = len(self.events("start"))
        begun = _step(self.events("start")[-1])
        _wait("the job to train", lambda: self.trained_past(None if begun is None else begun + 2))
        sent = time.time()
        do()
        stop = _wait(f"the job to save after {how}", lambda: self.events("interrupted")[n:])[0]
        if failed := self.events("requeue_failed")[-1:]:
            raise DrillFailed(
                f"rank 0 could not requeue the job after {how} (at step {failed[0]['step']}: {failed[0]['error']})"
            )
        if stop["kind"] != expect_kind:
            raise DrillFailed(f"{how} was taken for a {stop['kind']}, not a {expect_kind}")
        start = _wait(f"the job to come back after {how}", lambda: self.events("start")[starts:])[0]
        stopped = _step(stop)
        if _step(start) != stopped or str(start["job_id"]) != self.job_id:
            raise DrillFailed(
                f"after {how} the job resumed at step {start.get('step')} (job {start['job_id']}), "
                f"not at its checkpoint of step {stopped} (job {self.job_id})"
            )
        first = _wait(f"a step after {how}", lambda: self.trained_past(stopped))
        requeued = self.events("requeued")[-1:] if expect_kind != "terminated" else []
        return Timing(
            how, stopped, stop["t"] - sent, requeued[0]["t"] - sent if requeued else None, first["time"] - sent
        )

    def final_digest(self, job_id: str, run: RunDir) -> str:
        _wait(f"job {job_id} to end", lambda: not self.gateway.squeue_ids([job_id]))
        logs = sorted(run.slurm.glob(f"{job_id}_0_log.err"))
        found = DIGEST.findall(logs[0].read_text()) if logs else []
        if not found:
            raise DrillFailed(f"job {job_id} ended without its final weights (see {run.slurm})")
        return found[-1]


def submit_pair(partition: Optional[str], overrides: Sequence[str], root: Path) -> list[tuple[Config, RunDir, str]]:
    from jobs.submission import checks
    from jobs.submission.submit import submit

    out = []
    for _ in range(2):
        cfg = load_config(None, [*DRILL_SETTINGS, f"run.root={root}", *overrides])
        if partition:
            cfg.slurm.partition = partition
        request = checks.check_and_resolve(cfg, run_root=root.resolve())
        run = create_run_dir(cfg)
        out.append((cfg, run, submit(cfg, request, run).job_id))
    return out


def run_drill(
    partition: Optional[str], preempt_from: Optional[str], overrides: Sequence[str], gateway: SlurmGateway = GATEWAY
) -> tuple[list[Finding], list[Timing]]:
    root = private.temp_folder("drill", Path.cwd(), prefix=".ddpjob")  # on the shared file system
    jobs: list[str] = []
    timings: list[Timing] = []
    findings: list[Finding] = []
    try:
        (cfg, run, job_id), (_, twin, twin_id) = submit_pair(partition, overrides, root)
        jobs = [job_id, twin_id]
        drill = Drill(cfg, run, job_id, gateway)
        sig = cfg.slurm.warning
        timings.append(
            drill.interrupt(f"the warning signal (SIG{sig})", lambda: _check(gateway.signal(job_id, sig)), "preemption")
        )
        timings.append(
            drill.interrupt("scontrol requeue (SIGTERM)", lambda: _check(gateway.requeue(job_id)), "terminated")
        )
        if preempt_from:
            # The drill job's nodes, whole: Slurm must preempt it (and only what shares those nodes) to start this.
            info = gateway.show_job(job_id)
            nodes = info.raw.get("NodeList", "") if info else ""
            hold = [
                "-p",
                preempt_from,
                "-N",
                # the nodes the drill job got (an elastic one: any count of its range), else its minimum
                (info.raw.get("NumNodes", "") if info else "").split("-")[0] or str(cfg.slurm.min_nodes),
                "--exclusive",
                "-o",
                "/dev/null",
                *([f"--nodelist={nodes}"] if nodes else []),
            ]
            timings.append(
                drill.interrupt(
                    f"preemption from {preempt_from}",
                    lambda: _check_id(gateway.sbatch_wrap(hold, "sleep 2"), jobs),
                    "preemption",
                )
            )
        mine, theirs = drill.final_digest(job_id, run), drill.final_digest(twin_id, twin)
        if mine != theirs:
            raise DrillFailed(
                f"the interrupted job's weights differ from its uninterrupted twin's ({mine[:12]} vs {theirs[:12]})"
            )
        findings = [
            Finding(
                "drill",
                "ok",
                f"saved, requeued and resumed {len(timings)} times; final weights equal the "
                f"uninterrupted twin's (sha256 {mine[:12]})",
            ),
            Finding("scontrol_on_nodes", "ok", "rank 0 requeued its own job from the compute node"),
        ]
    except DrillFailed as err:
        fix = "read the drill job's logs above; `ddpjob doctor` lists the cluster's settings"
        if "could not requeue" in str(err):
            fix = "the compute nodes need scontrol (and the Slurm config) for self-requeue: ask the site's admins"
        findings.append(Finding("drill", "problem", f"{err} ({_states(gateway, jobs)})", fix))
    finally:
        if jobs:
            gateway.cancel(jobs)
            try:  # a cancelled job still writes until its ranks are gone: remove its directory after that
                _wait("the drill's jobs to leave the queue", lambda: not gateway.squeue_ids(jobs), 120)
            except DrillFailed as err:
                findings.append(Finding("drill_cleanup", "warn", str(err), f"scancel {' '.join(jobs)}; rm -r {root}"))
        shutil.rmtree(root, ignore_errors=True)
    return findings, timings


def _states(gateway: SlurmGateway, jobs: Sequence[str]) -> str:
    """Where each drill job stood when the drill gave up: what a stuck preemption or requeue is diagnosed from."""
    out = []
    for job in jobs:
        info = gateway.show_job(job)
        where = f"{info.state} ({info.reason}) on {info.raw.get('NodeList') or '-'}" if info else "gone"
        out.append(f"job {job}: {where}")
    return "; ".join(out) or "no jobs"


def _check(proc: Any) -> None:
    if proc.returncode != 0:
        raise DrillFailed(f"{' '.join(proc.args[:2])} failed: {proc.stderr.strip()}")


def _check_id(job_id: Optional[str], jobs: list[str]) -> None:
    if job_id is None:
        raise DrillFailed("the preempting job was refused by sbatch")
    jobs.append(job_id)


def render_timings(timings: list[Timing]) -> str:
    lines = ["interruption                          stopped at  saved   requeued  first resumed step"]
    for t in timings:
        requeued = f"{t.requeued_s:6.2f} s" if t.requeued_s is not None else "   Slurm"
        step = "-" if t.step is None else t.step
        lines.append(f"{t.how:<37} step {step:<5} {t.saved_s:5.2f} s {requeued}  {t.resumed_s:6.2f} s")
    return "\n".join(lines)
