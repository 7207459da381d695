"""``ddpjob doctor``: what this cluster does to a job that is preempted or reaches its time limit, what ddpjob
then does, and what would lose work there.

Read-only: the cluster's settings come through the Slurm gateway (``scontrol show config``, ``scontrol show partition``,
and ``sacctmgr`` for QOS and association limits where accounting exists); how long a checkpoint takes comes from a run's
``metrics.jsonl``; the release and the compute nodes are ``jobs.doctor.node_probe``'s. Every check is one ``Finding``
with a stable key. A "problem" is work that would be lost; it names its fix (a config key, or what to ask the site's
admins) and exits 1.
"""

from __future__ import annotations

import argparse
import getpass
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from ddp_core.cluster import signals
from ddp_core.cluster.slurm import DEFAULT_MAX_ARRAY_SIZE, GATEWAY, SlurmGateway
from ddp_core.cluster.slurm_text import duration_s, effective_preempt_mode
from ddp_core.errors import DdpJobError
from jobs.doctor.drill import render_timings, run_drill
from jobs.doctor.findings import Finding, node_count_finding, render
from jobs.doctor.node_probe import site_findings
from jobs.doctor.run_settings import RunInfo, read_run
from jobs.runs.listing import shown_path
from jobs.runs.lookup import RUN_HELP
from jobs.submission import limits

# A save measured at S seconds is given 1.5 S + 5 s: the step in flight ends first, and a busy file system
# (many jobs checkpointing at once when a big job preempts them) is slower than when it was measured.
MARGIN_FACTOR, MARGIN_S = 1.5, 5.0
QOS_FIELDS = ("Name", "Preempt", "PreemptMode", "GraceTime", "MaxSubmitPU")
PREEMPTIBLE = ("REQUEUE", "CANCEL")  # the modes that end an attempt (SUSPEND and GANG only pause it)


@dataclass(frozen=True)
class Cluster:
    """What Slurm says, read once."""

    config: dict[str, str]
    partition: dict[str, str]
    partitions: list[dict[str, str]]
    qos: Optional[list[dict[str, str]]]  # None: no accounting to ask
    assoc: Optional[list[dict[str, str]]]
    sacct_error: Optional[str]  # None: sacct answers

    @property
    def name(self) -> str:
        return self.partition.get("PartitionName", "?")

    @property
    def kill_wait(self) -> int:
        return duration_s(self.config.get("KillWait", "30"))


@dataclass(frozen=True)
class Exposure:
    """How a job of the partition (under preempt/qos: of its QOS) is preempted."""

    kind: str  # none | partition_prio | qos
    mode: str  # REQUEUE | CANCEL | SUSPEND | GANG | OFF | UNKNOWN (preempt/qos without accounting)
    grace_s: int
    where: str  # "partition low", "QOS low"
    by: tuple[str, ...] = ()  # the partitions or QOS whose jobs preempt it
    rules: tuple[str, ...] = ()  # preempt/qos: every "A preempts B (mode, GraceTime)" of the cluster


def read_cluster(gateway: SlurmGateway, partition: Optional[str]) -> Cluster:
    config = gateway.show_config(required=True)
    assert config is not None  # required: it raises instead
    partitions = gateway.show_partitions()
    names = ", ".join(p.get("PartitionName", "?") for p in partitions) or "none"
    if partition is None:
        part = next((p for p in partitions if p.get("Default") == "YES"), None)
        if part is None:
            raise DdpJobError("the cluster has no default partition", f"pass --partition, one of: {names}")
    elif (part := gateway.show_partition(partition)) is None:  # asked by name: a hidden one answers too
        raise DdpJobError(f"partition {partition!r} not found", f"use --partition and slurm.partition from: {names}")
    if config.get("AccountingStorageType", "none").endswith("none"):
        return Cluster(config, part, partitions, None, None, "AccountingStorageType=accounting_storage/none")
    qos = gateway.qos_records(QOS_FIELDS)
    assoc = gateway.associations(getpass.getuser(), limits.ASSOC_FIELDS)
    return Cluster(config, part, partitions, qos, assoc, gateway.accounting_error())


def _job_qos(c: Cluster, qos: Optional[str]) -> str:
    """The run's slurm.qos, else the user's default QOS, else Slurm's own default."""
    return limits.job_qos(c.assoc or [], qos)


def exposure(c: Cluster, qos: Optional[str] = None) -> Exposure:
    kind = c.config.get("PreemptType", "preempt/none").removeprefix("preempt/")
    if kind == "partition_prio":
        tier = int(c.partition.get("PriorityTier") or 1)
        by = tuple(p["PartitionName"] for p in c.partitions if int(p.get("PriorityTier") or 1) > tier)
        mode = effective_preempt_mode(c.config, c.partition, "")
        return Exposure(kind, mode, duration_s(c.partition.get("GraceTime", "0")), f"partition {c.name}", by)
    if kind != "qos":
        return Exposure("none", "OFF", 0, f"partition {c.name}")
    name = _job_qos(c, qos)
    if c.qos is None:
        return Exposure(kind, "UNKNOWN", 0, f"QOS {name}")
    records = {q["Name"]: q for q in c.qos}
    # A preempted job goes by its own QOS's PreemptMode ("cluster": the global one) and GraceTime.
    modes = {n: effective_preempt_mode(c.config, {}, q.get("PreemptMode", "")) for n, q in records.items()}
    graces = {n: duration_s(q.get("GraceTime", "")) for n, q in records.items()}
    pairs = [(q["Name"], victim) for q in c.qos for victim in q.get("Preempt", "").split(",") if victim]
    rules = tuple(f"{a} preempts {b} ({modes.get(b, '?')}, GraceTime {graces.get(b, 0)} s)" for a, b in pairs)
    by = tuple(a for a, b in pairs if b == name)
    mode = modes.get(name, effective_preempt_mode(c.config, {}, "")) if by else "OFF"
    return Exposure(kind, mode, graces.get(name, 0), f"QOS {name}", by, rules)


def _preempt_mode(e: Exposure) -> Finding:
    if e.mode == "UNKNOWN":
        why = f"{e.where}: which QOS preempts which needs sacctmgr, and accounting does not answer"
        return Finding("preempt_mode", "unknown", why, "ask the admins how their QOS preempt")
    if e.mode == "OFF":
        rules = f"; QOS: {', '.join(e.rules)}" if e.rules else ""
        return Finding("preempt_mode", "ok", f"{e.where}: not preempted (PreemptMode=OFF){rules}", value="OFF")
    by = f"by jobs of {', '.join(e.by)}" if e.by else "by nothing today (no partition has a higher PriorityTier)"
    rules = f"; QOS: {', '.join(e.rules)}" if e.rules else ""
    return Finding("preempt_mode", "info", f"{e.where}: PreemptMode={e.mode}, preempted {by}{rules}", value=e.mode)


def _grace_time(e: Exposure, kill_wait: int) -> Finding:
    if e.mode not in PREEMPTIBLE:
        why = "GraceTime does not apply: preemption never ends this job's attempts"
    elif e.grace_s:
        why = f"GraceTime={e.grace_s} s ({e.where}): a preempted job gets a signal and {e.grace_s} s before the kill"
    else:
        why = f"GraceTime=0 ({e.where}): a preempted job ends at once, killed KillWait={kill_wait} s after SIGTERM"
    return Finding("grace_time", "info", why, value=e.grace_s)


def _send_user_signal(e: Exposure, user_signal: bool) -> Finding:
    if user_signal:
        return Finding("send_user_signal", "ok", "preemption sends the job's warning signal first", value=True)
    why = "preemption sends SIGTERM (no preempt_send_user_signal in SlurmctldParameters)"
    return Finding("send_user_signal", "info" if e.mode in PREEMPTIBLE else "ok", why, value=False)


def _job_requeue(c: Cluster) -> Finding:
    if c.config.get("JobRequeue", "1").strip() != "0":
        return Finding("job_requeue", "ok", "JobRequeue=1: batch jobs may be requeued", value=1)
    # JobRequeue is only the default for jobs that say nothing (slurm.conf(5)): submitit and
    # slurm_templates/ddp.sbatch both pass --requeue, so ddpjob's own jobs still come back.
    why = "JobRequeue=0: only jobs submitted with --requeue (as ddpjob's are) come back after a preemption or timeout"
    fix = "keep `#SBATCH --requeue` in hand-written scripts, or continue with `ddpjob resume RUN`"
    return Finding("job_requeue", "warn", why, fix, 0)


def _actions(e: Exposure, run: RunInfo, user_signal: bool) -> list[Finding]:
    """What the trainer does then (ddp_core.cluster.preemption.decide), one line per case."""
    signal = f"{run.signal} (preempt_send_user_signal)" if user_signal else "SIGTERM"
    what = {
        "REQUEUE": f"preempted: {signal} -> every rank checkpoints at the next step, rank 0 runs `scontrol requeue` "
        "itself within the grace time, and the next attempt resumes exactly",
        "CANCEL": f"preempted: {signal} -> every rank checkpoints at the next step and the job ends; `ddpjob status`"
        " shows it preempted and `ddpjob resume RUN` continues it",
        "SUSPEND": "preempted: the job is paused and later continues where it stopped; nothing to do",
        "GANG": "time-sliced: the job is paused and later continues where it stopped; nothing to do",
        "OFF": "not preempted",
        "UNKNOWN": "preemption depends on the job's QOS, which cannot be read here",
    }
    timeout = f"time limit: {run.signal} {run.signal_lead_s} s before the end (slurm.signal_lead_s) -> checkpoint "
    if run.signal == "none":
        timeout = (f"time limit: no warning signal (slurm.signal: none); the trainer stops itself once a save and "
                   f"slurm.deadline_margin_s={run.deadline_margin_s} would no longer fit -> checkpoint ")  # fmt: skip
    return [
        Finding("on_preemption", "info", what.get(e.mode, f"PreemptMode={e.mode}: not handled"), value=e.mode),
        Finding("on_time_limit", "info", timeout + "and requeue (slurm.max_timeouts budget)", value=run.signal_lead_s),
    ]


def _save_fits(e: Exposure, run: RunInfo, need: int, window: int, took: str) -> Finding:
    values = {"save_s": run.save_s, "needed_s": need, "window_s": window}
    if e.mode not in PREEMPTIBLE:
        return Finding("save_fits", "ok", f"{took}; not preempted here", value=values)
    if need <= window:
        return Finding("save_fits", "ok", f"{took}: fits the {window} s before SIGKILL", value=values)
    source = "GraceTime" if e.grace_s else "KillWait, as GraceTime=0"
    why = f"{took}, but only {window} s ({source}) before SIGKILL: the steps since the last checkpoint are lost"
    fix = f"ask the admins for GraceTime >= {need} s on {e.where}; meanwhile lower checkpoint.every_steps (now "
    return Finding("save_fits", "problem", why, fix + f"{run.every_steps}) to lose less", values)


def _sigterm_budget(e: Exposure, run: RunInfo, need: int, window: int, user_signal: bool) -> Finding:
    """Where preemption arrives as SIGTERM the trainer saves only if its last save took <= sigterm_budget_s."""
    budget, save_s = run.sigterm_budget_s, run.save_s or 0.0
    if e.mode not in PREEMPTIBLE or user_signal or save_s <= budget:
        why = f"checkpoint.sigterm_budget_s={budget:g}: the trainer saves on SIGTERM"
        return Finding("sigterm_budget", "ok", why, value=budget)
    why = f"preemption sends SIGTERM and a save took {save_s:.3g} s > checkpoint.sigterm_budget_s={budget:g}: no "
    why += f"save then, up to checkpoint.every_steps={run.every_steps} steps are lost"
    fix = f"set checkpoint.sigterm_budget_s={need}" + ("" if need <= window else " once GraceTime allows it")
    return Finding("sigterm_budget", "problem", why, fix + ", or ask the admins for preempt_send_user_signal", budget)


def _signal_lead(run: RunInfo, need: int) -> Finding:
    # The requeue must happen before the limit: a job still running then ends TIMEOUT and is not requeued.
    if run.signal == "none":
        why = "slurm.signal: none: the trainer's deadline stop leaves the save it measured before the time limit"
        return Finding("signal_lead", "ok", why, value=None)
    if need <= run.signal_lead_s:
        why = f"slurm.signal_lead_s={run.signal_lead_s}: leaves the {need} s a save needs before the time limit"
        return Finding("signal_lead", "ok", why, value=run.signal_lead_s)
    why = f"slurm.signal_lead_s={run.signal_lead_s} is less than the {need} s a save needs: killed at the time limit"
    return Finding("signal_lead", "problem", why, f"set slurm.signal_lead_s={need} or more", run.signal_lead_s)


def _saves(c: Cluster, e: Exposure, run: RunInfo, user_signal: bool) -> list[Finding]:
    if run.save_s is None:
        why = "no checkpoint measured yet: pass --run RUN_DIR of a run that saved one"
        return [Finding(key, "unknown", why) for key in ("save_fits", "sigterm_budget", "signal_lead")]
    need = math.ceil(run.save_s * MARGIN_FACTOR + MARGIN_S)
    took = f"a checkpoint save took {run.save_s:.3g} s ({shown_path(run.path or Path())}), {need} s with margin"
    window = e.grace_s or c.kill_wait  # without GraceTime a preempted job ends like a scancel: KillWait
    return [
        _save_fits(e, run, need, window, took),
        _sigterm_budget(e, run, need, window, user_signal),
        _signal_lead(run, need),
    ]


def _max_submit_jobs(c: Cluster, qos: str) -> Finding:
    if c.qos is None or c.assoc is None:
        return Finding("max_submit_jobs", "unknown", "no accounting: submit limits cannot be read")
    if (found := limits.submit_limit(c.qos, c.assoc, qos, c.name)) is None:
        return Finding("max_submit_jobs", "ok", "no MaxSubmitJobs limit applies to you")
    limit, source = found
    why = f"at most {limit} queued jobs ({source}); each array task counts, so sbatch refuses a larger sweep"
    fix = f"submit sweeps of at most {limit} trials (fewer values or --trials); `ddpjob sweep` again adds the rest"
    return Finding("max_submit_jobs", "warn", why, fix, limit)


def _cluster_facts(c: Cluster, e: Exposure) -> list[Finding]:
    kinds = {
        "none": "nothing is preempted",
        "partition_prio": "a higher PriorityTier partition preempts",
        "qos": "a QOS preempts the QOS it lists (sacctmgr Preempt)",
    }
    cluster = f"{c.config.get('ClusterName', '?')} (Slurm {c.config.get('SLURM_VERSION', '?')})"
    return [
        Finding("partition", "info", f"partition {c.name} of cluster {cluster}", value=c.name),
        Finding("preempt_type", "info", f"PreemptType=preempt/{e.kind}: {kinds.get(e.kind, '?')}", value=e.kind),
        _preempt_mode(e),
        _grace_time(e, c.kill_wait),
        Finding("kill_wait", "info", f"KillWait={c.kill_wait} s from SIGTERM to SIGKILL", value=c.kill_wait),
    ]


def _limits_and_access(c: Cluster, qos: str) -> list[Finding]:
    size = int(c.config.get("MaxArraySize", "") or DEFAULT_MAX_ARRAY_SIZE)
    if c.sacct_error is None:
        accounting = Finding("accounting", "ok", "sacct answers: `ddpjob status` shows each attempt", value=True)
    else:
        why = (
            f"no accounting ({c.sacct_error}): `ddpjob status` reads states from the controller and RUN/attempts.jsonl"
        )
        accounting = Finding("accounting", "warn", why, "ask the admins for accounting (slurmdbd)", False)
    return [
        Finding("max_array_size", "info", f"MaxArraySize={size}: one job array per {size} trials", value=size),
        _max_submit_jobs(c, qos),
        accounting,
    ]


def _held_signals() -> Finding:
    """How tasks hold the warning signal and SIGTERM until their handlers are up (ddp_core.cluster.signals), from this
    machine's ``env``: compute nodes run the same image on the clusters we know of."""
    if signals.env_blocks_signals():
        held = "tasks start with the warning signal and SIGTERM blocked (env --block-signal): one in the first second "
        return Finding("held_signals", "ok", held + "waits for the handlers", value="env")
    held = "env lacks --block-signal (coreutils before 8.31): tasks block the warning signal and SIGTERM from a "
    return Finding("held_signals", "info", held + "`python -I -S` bootstrap, ~20 ms after they start", value="python")


def diagnose(
    gateway: SlurmGateway = GATEWAY, partition: Optional[str] = None, run: Optional[Path] = None
) -> list[Finding]:
    c = read_cluster(gateway, partition)
    info = read_run(run)
    e = exposure(c, info.qos)
    user_signal = "preempt_send_user_signal" in c.config.get("SlurmctldParameters", "").split(",")
    return [
        *_cluster_facts(c, e),
        _send_user_signal(e, user_signal),
        _job_requeue(c),
        node_count_finding(*info.nodes, c.name, int(c.partition.get("TotalNodes") or 0)),
        *_actions(e, info, user_signal),
        *_saves(c, e, info, user_signal),
        *_limits_and_access(c, _job_qos(c, info.qos)),
        _held_signals(),
        *site_findings(gateway, c.name, c.config.get("SLURM_VERSION", ""), info.image),
    ]


def cmd_doctor(args: argparse.Namespace) -> int:
    findings = diagnose(partition=args.partition, run=Path(args.run) if args.run else None)
    timings = ""
    if args.drill:
        drilled, measured = run_drill(args.partition, args.preempt_from, args.overrides)
        # The drill answers what the configuration cannot: its findings replace the static guesses.
        findings = [f for f in findings if f.key not in {d.key for d in drilled}] + drilled
        timings = render_timings(measured) if measured else ""
    elif args.preempt_from or args.overrides:
        raise DdpJobError("--preempt-from and key=value settings are for the drill", "add --drill")
    print(json.dumps([asdict(f) for f in findings], indent=1) if args.json else render(findings))
    if timings and not args.json:
        print(timings)
    return 1 if any(f.level == "problem" for f in findings) else 0


def add_parser(sub: Any) -> None:
    """Register ``doctor`` on ``ddpjob``'s subparsers."""
    p = sub.add_parser("doctor", help="what preemption and time limits do to jobs here, and what would lose work")
    p.add_argument("--partition", help="the partition to check (default: the cluster's default partition)")
    p.add_argument("--run", metavar="RUN", help=f"the run whose save time counts (default: the newest): {RUN_HELP}")
    p.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    p.add_argument(
        "--drill",
        action="store_true",
        help="submit a tiny 2-rank job and its twin, interrupt it as Slurm would, check that it saves, "
        "requeues and resumes to the twin's weights; print the timings (~2 min; cleans up)",
    )
    p.add_argument(
        "--preempt-from",
        metavar="PARTITION",
        help="drill: also preempt the job by submitting to this higher-priority partition",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="drill: settings for its jobs, e.g. slurm.gpus_per_node=2 slurm.account=x",
    )


COMMANDS = {"doctor": cmd_doctor}
