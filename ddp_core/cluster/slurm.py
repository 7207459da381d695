"""The one gateway to Slurm's commands (sinfo, squeue, sacct, sacctmgr, scontrol, scancel, sbatch), for both sides.

Every call goes through ``SlurmGateway.run`` and its one injectable runner, so tests can hand in fabricated
output (or count calls) and a missing client or a slow controller is handled in one place. Torch-free:
the login node (``jobs``, which queues every job here: ``sbatch``) and the compute-node trainer both import it.
"""

from __future__ import annotations

import datetime
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ddp_core.cluster.backoff import Backoff
from ddp_core.cluster.slurm_text import (
    MISSING,
    NOT_STARTED,
    RATE_LIMITED,
    TIMED_OUT,
    accounting_failure,
    config_answer,
    effective_preempt_mode,
    exit_text,
    first_word_state,
    out_of_memory_peak,
    parse_fields,
    parse_node,
    queue_extra,
    rate_limited,
)
from ddp_core.errors import DdpJobError

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]
TIMEOUT_S = 60
MEMORY_TRIES = 15  # sacct asked up to this many times, a second apart, for an out-of-memory step's peak
# partition (``*``: the default), nodes, CPUs per node, GRES: jobs.submission.partitions reads it
SINFO_FORMAT = "%P|%D|%c|%G"
DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's own default, when the configuration does not say


def run_command(cmd: Sequence[str], timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """The real runner, which never raises: a missing command gives code 127, one that cannot start 126 (as a shell),
    a timeout 124 (as timeout(1)), so callers decide what an absent or stuck controller means for them."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        code, why = MISSING, f"{cmd[0]}: command not found"
    except OSError as err:  # the process could not be started: seen as EFAULT from a node's fork under load
        code, why = NOT_STARTED, f"{cmd[0]}: could not be started: {err}"
    except subprocess.TimeoutExpired:
        code, why = TIMED_OUT, f"{cmd[0]} did not answer within {timeout_s:g} s"
    return subprocess.CompletedProcess(list(cmd), code, "", why)


# The trainer asks Slurm between its checkpoint and its exit, inside a grace time (often 30-120 s) or the warning
# signal's lead: a controller that does not answer within this is treated as absent (the decision falls back).
NODE_TIMEOUT_S = 15


@dataclass(frozen=True)
class JobInfo:
    """What ``scontrol show job`` says about a job, in the fields the trainer and doctor decide on."""

    job_id: str
    state: str  # RUNNING, CANCELLED, PREEMPTED, REQUEUED, TIMEOUT, ...
    reason: str
    requeue: bool  # Requeue=1: the job may be requeued
    preempt_time: Optional[str]  # set once the job was chosen for preemption
    partition: str
    qos: str
    end_time: Optional[str]  # ISO time, or None when unknown/unlimited
    restarts: int
    raw: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def started(self) -> Optional[float]:
        """When this allocation started (a requeue's is its own), as ``time.time()`` says it; None when unknown."""
        try:
            return datetime.datetime.fromisoformat(self.raw.get("StartTime", "")).timestamp()
        except ValueError:
            return None


def _time(value: str) -> Optional[str]:
    return value if value and value[0].isdigit() else None


class SlurmBusy(DdpJobError):
    """The controller still refused a login-side call for its rate limit after the gateway's own retries: "try
    again later", never "no such job". A watcher (``jobs.runs.watcher``) keeps what it knew and asks later."""


def _answered(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """Login-side queries: a controller that does not answer, or that rate-limits the caller, is the user's to see
    as one line, not a traceback or an empty answer that reads as "no jobs" (the trainer's calls never raise: they
    return None instead)."""
    if proc.returncode == TIMED_OUT:
        raise DdpJobError(f"{proc.args[0]} did not answer within {TIMEOUT_S} s", "is the Slurm controller up? (sinfo)")
    if proc.returncode == RATE_LIMITED:
        raise SlurmBusy(
            f"{proc.args[0]}: the Slurm controller rate-limits your calls ({proc.stderr.strip().splitlines()[-1]})",
            "wait a minute and run it again; stop other loops that poll Slurm (watch squeue, scripts)",
        )
    return proc


@dataclass(frozen=True)
class Accounting:
    """What ``sacct`` answered: its rows, or, where accounting does not answer, none and the one line why."""

    rows: list[list[str]]
    error: Optional[str] = None  # None: accounting answered (maybe with no rows yet)


@dataclass(frozen=True)
class QueuedJob:
    """One job as the controller holds it (``squeue -t all``): the fallback where accounting does not answer, and
    ``--wait``'s one query per poll (its pending reason and Slurm's start estimate come in the same answer)."""

    job_id: str  # as listed: 5301, or an array task 5301_3 (5301_[4-9%2]: its tasks not started yet)
    raw_id: str
    state: str
    restarts: int
    exit_code: str  # "3:0" as sacct writes it: the exit code, then the signal
    reason: str = ""  # why it pends (Priority, Resources, BeginTime, ...); "None" once it runs
    start_time: str = ""  # ISO time: when it started, or Slurm's estimate while it pends; "" when unknown (N/A)


@dataclass
class SlurmGateway:
    runner: Runner = run_command
    # How long ``run`` keeps asking again, on the back-off schedule, while the controller answers a call with its rate
    # limit; then the call's code is RATE_LIMITED (login side: ``SlurmBusy``). 0: the caller backs off itself.
    rate_limit_wait_s: float = 60.0
    sleep: Callable[[float], None] = time.sleep

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        """The one call of the runner. A rate-limited answer (``slurm_text.rate_limited``) is asked again after the
        back-off's delays, never read as an answer: after ``rate_limit_wait_s`` it comes back as RATE_LIMITED."""
        backoff, waited = Backoff(first_s=1.0), 0.0
        while True:
            proc = self.runner(cmd)
            if not rate_limited(proc):
                return proc
            delay = backoff.next()
            if waited + delay > self.rate_limit_wait_s:
                return subprocess.CompletedProcess(proc.args, RATE_LIMITED, proc.stdout, proc.stderr)
            self.sleep(delay)
            waited += delay

    def show_job(self, job_id: str) -> Optional[JobInfo]:
        """None when scontrol is missing or the job is unknown (it left the controller's memory)."""
        proc = self.run("scontrol", "show", "job", "-o", job_id)
        if proc.returncode != 0 or not proc.stdout.strip():
            return None
        f = parse_fields(proc.stdout.splitlines()[0])
        return JobInfo(
            job_id=f.get("JobId", job_id),
            state=f.get("JobState", ""),
            reason=f.get("Reason", ""),
            requeue=f.get("Requeue") == "1",
            preempt_time=_time(f.get("PreemptTime", "")),
            partition=f.get("Partition", ""),
            qos=f.get("QOS", ""),
            end_time=_time(f.get("EndTime", "")),
            restarts=int(f["Restarts"]) if f.get("Restarts", "").isdigit() else 0,
            raw=f,
        )

    def show_config(self, required: bool = False) -> Optional[dict[str, str]]:
        """The controller's configuration (``config_answer``); None without one, or (``required``) one line why."""
        proc = self.run("scontrol", "show", "config")
        if (config := config_answer(proc)) is None and required:
            said = (_answered(proc).stderr or "").strip().splitlines() or [f"exit status {proc.returncode}"]
            raise DdpJobError(f"scontrol show config failed: {said[-1]}", "is slurmctld up? (sinfo)")
        return config

    def show_partition(self, name: str) -> Optional[dict[str, str]]:
        proc = self.run("scontrol", "show", "partition", "-o", name)
        return parse_fields(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None

    def show_qos(self, name: str) -> Optional[dict[str, str]]:
        """A QOS as the controller holds it (no slurmdbd client needed): ``scontrol show assoc_mgr``."""
        proc = self.run("scontrol", "show", "assoc_mgr", "flags=qos", f"qos={name}")
        if proc.returncode != 0:
            return None
        record = proc.stdout.split(f"QOS={name}(", 1)
        return parse_fields(record[1]) if len(record) == 2 else None

    def preempt_mode(self, job: JobInfo) -> Optional[str]:
        """How this job is preempted (``effective_preempt_mode``), asking only for what the cluster's PreemptType
        needs; None when the controller cannot be asked."""
        config = self.show_config()
        if config is None:
            return None
        kind = config.get("PreemptType", "")
        part = (self.show_partition(job.partition) or {}) if kind.endswith("partition_prio") else {}
        qos = (self.show_qos(job.qos) or {}) if kind.endswith("/qos") and job.qos else {}
        return effective_preempt_mode(config, part, qos.get("PreemptMode", ""))

    def requeue(self, job_id: str) -> subprocess.CompletedProcess[str]:
        return self.run("scontrol", "requeue", job_id)

    def update_job(self, job_id: str, **fields: object) -> subprocess.CompletedProcess[str]:
        """``scontrol update`` of a job back in the queue (a requeued job, even while it completes; not while it
        runs): ``ExcNodeList`` (its whole exclusion list), an elastic job's ``NumNodes`` range and ``NumTasks``."""
        return self.run("scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items()))

    # Login side (``jobs``). A missing client answers 127 like the shell: each caller says what that means to it.

    def partitions(self) -> subprocess.CompletedProcess[str]:
        """``sinfo`` lines ``NAME[*]|NODES|CPUS|GRES``, one per partition and node group (read by
        ``jobs.submission.partitions``)."""
        return _answered(self.run("sinfo", "-h", "-o", SINFO_FORMAT))

    def squeue_ids(self, job_ids: Sequence[str], strict: bool = False) -> list[tuple[str, str]]:
        """(id as listed, raw job id) of each job of ``job_ids`` still queued or running, array tasks one by one
        (``5301_3``): one call for all. An array's base id lists all its tasks. A failing squeue lists nothing, or,
        ``strict`` (before a run is started again: it must not run twice), is one line: fail closed."""
        if not job_ids:
            return []
        proc = _answered(self.run("squeue", "-h", "-r", "-o", "%i %A", "-j", ",".join(job_ids)))
        if strict and proc.returncode != 0 and "Invalid job id" not in proc.stderr:  # that one: none is queued
            why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            raise DdpJobError(
                f"squeue cannot say whether job {', '.join(job_ids)} is still queued or running ({why})",
                "run it again once squeue answers: a run must not be started while its job still runs",
            )
        pairs = (line.strip().partition(" ") for line in proc.stdout.splitlines())
        return [(job_id, raw.strip()) for job_id, _, raw in pairs if job_id]

    def queued_from(self, folder: str | Path) -> list[str]:
        """Ids of the user's queued or running jobs whose batch script lies in ``folder``. submitit writes the
        script there before sbatch, so this finds a job that sbatch accepted although the submit call raised."""
        prefix = str(Path(folder).resolve()) + "/"
        proc = _answered(self.run("squeue", "--me", "-h", "-o", "%F|%o"))
        rows = (line.partition("|") for line in proc.stdout.splitlines())
        return sorted({job_id.strip() for job_id, _, script in rows if script.strip().startswith(prefix)})

    def sacct(self, job_ids: Sequence[str], fields: str, attempts: bool = False) -> Accounting:
        """``sacct`` rows of the jobs' allocations (no steps), split into ``fields``; with ``attempts`` one row per
        attempt of a requeued job (``-D``). Where accounting does not answer, no rows and the one line why
        (``Accounting.error``): callers fall back to the controller (``queue_states``) and say what they cannot know."""
        if not job_ids:
            return Accounting([])
        flags = ["-n", "-P", *(["-D"] if attempts else []), "-X", "-o", fields, "-j", ",".join(job_ids)]
        proc = self.run("sacct", *flags)
        if (error := accounting_failure(proc)) is not None:
            return Accounting([], error)
        return Accounting([line.split("|") for line in proc.stdout.splitlines() if line.strip()])

    def sacct_state(self, job_id: str) -> str:
        """The job's state from accounting, first word ('CANCELLED by 0' → 'CANCELLED'); '' if unknown yet or
        accounting does not answer."""
        return first_word_state(self.sacct([job_id], "State").rows)

    def accounting_error(self) -> Optional[str]:
        """None when ``sacct`` answers (a query for one job id), else the one line why it does not."""
        return accounting_failure(self.run("sacct", "-n", "-X", "-P", "-o", "JobID", "-j", "1"))

    def queue_states(self, job_ids: Sequence[str]) -> list[QueuedJob]:
        """What the controller itself says about the jobs (``squeue -t all``), array tasks one by one: the queued
        and running ones, and the ended ones it still remembers (for ``MinJobAge`` seconds after their end). One row
        per job, not per attempt: without accounting, earlier attempts are not known. [] when squeue fails."""
        if not job_ids:
            return []
        fmt = "JobArrayID:|,JobID:|,State:|,RestartCnt:|,exit_code:|,Reason:|,StartTime:"
        proc = _answered(self.run("squeue", "-h", "-r", "-t", "all", "-O", fmt, "-j", ",".join(job_ids)))
        rows = (line.strip().split("|") for line in proc.stdout.splitlines() if proc.returncode == 0)
        return [
            QueuedJob(r[0], r[1], r[2], int(r[3]) if r[3].isdigit() else 0, exit_text(r[4]), *queue_extra(r[5:7]))
            for r in rows
            if len(r) >= 5
        ]

    def job_end(self, job_id: str) -> tuple[str, Optional[str]]:
        """How a job that left the queue ended: (state, None) from accounting, else (state from the controller's
        memory or "", the one line why accounting did not answer)."""
        answer = self.sacct([job_id], "State")
        if answer.error is None:
            return first_word_state(answer.rows), None
        known = [q.state for q in self.queue_states([job_id]) if job_id in (q.job_id, q.raw_id)]
        return (known[0] if known else ""), answer.error

    def version(self) -> str:
        """The controller's release ("22.05.8", from ``scontrol show config``), else the client's (``scontrol
        --version``: "slurm 24.11.5"); "" when neither answers."""
        if found := (self.show_config() or {}).get("SLURM_VERSION"):
            return found
        proc = self.run("scontrol", "--version")
        return proc.stdout.split()[-1] if proc.returncode == 0 and proc.stdout.split() else ""

    def run_on_node(self, partition: str, argv: Sequence[str], wait_s: int) -> subprocess.CompletedProcess[str]:
        """``argv`` as one task on one node of ``partition`` (``srun``, a minute at most). A partition that cannot give
        a node within ``wait_s`` fails the call (``--immediate``), so a busy cluster never holds the caller."""
        opts = ["-p", partition, "-N1", "-n1", "--time=1", f"--immediate={wait_s}", "--quiet"]
        return self.run("srun", *opts, *argv)

    def run_on_each(self, nodes: Sequence[str], argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Inside a job (its batch script): ``argv`` once on each of ``nodes``, beside whatever step runs there."""
        n = len(nodes)
        opts = [f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", "--overlap"]
        return self.run("srun", *opts, "--quiet", *argv)

    def srun_help(self) -> str:
        """``srun --help``: what this srun takes (a SPANK plugin such as pyxis adds its options there)."""
        proc = self.run("srun", "--help")
        return proc.stdout if proc.returncode == 0 else ""

    def cancel(self, job_ids: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return _answered(self.run("scancel", *job_ids))

    def signal(self, job_id: str, name: str) -> subprocess.CompletedProcess[str]:
        """Send signal ``name`` (USR2, TERM, ...) to every task of the job's steps (not its batch shell)."""
        return _answered(self.run("scancel", f"--signal={name}", job_id))

    def sbatch(self, script: str | Path) -> subprocess.CompletedProcess[str]:
        """Queue a batch script file; sbatch's answer names the job (``Submitted batch job ID``)."""
        return _answered(self.run("sbatch", str(script)))

    def sbatch_wrap(self, options: Sequence[str], command: str) -> Optional[str]:
        """Submit ``command`` as a batch job; its id, or None when sbatch refused (stderr is lost: the caller says
        what the job was for)."""
        proc = _answered(self.run("sbatch", "--parsable", *options, "--wrap", command))
        return proc.stdout.strip().split(";")[0] or None if proc.returncode == 0 else None

    def max_array_size(self) -> int:
        """The cluster's MaxArraySize: array indices must stay below it."""
        value = (self.show_config() or {}).get("MaxArraySize", "")
        return int(value) if value.isdigit() else DEFAULT_MAX_ARRAY_SIZE

    def show_partitions(self) -> list[dict[str, str]]:
        """Every partition the user may see (``scontrol show partition -o``); [] when scontrol cannot answer."""
        proc = self.run("scontrol", "show", "partition", "-o")
        lines = proc.stdout.splitlines() if proc.returncode == 0 else []
        return [parse_fields(line) for line in lines if line.startswith("PartitionName=")]

    def show_node(self, name: str) -> Optional[dict[str, str]]:
        """``scontrol show node -o NAME``'s fields (``Reason`` whole, spaces and all, less Slurm's ``[user@time]``);
        None when scontrol cannot answer."""
        proc = self.run("scontrol", "show", "node", "-o", name)
        return parse_node(proc.stdout.splitlines()[0]) if proc.returncode == 0 and proc.stdout.strip() else None

    def nodes_down_between(self, nodes: Sequence[str], start: str, end: str) -> Optional[list[str]]:
        """The ``nodes`` accounting saw go down (not responding, failed) between ``start`` and ``end`` (ISO times),
        in the order they went; None without accounting."""
        rows = self._sacctmgr(
            "event",
            ["NodeName", "TimeStart", "State"],
            "where",
            f"nodes={','.join(nodes)}",
            f"start={start}",
            f"end={end}",
        )
        if rows is None:
            return None
        down = sorted(
            (r["TimeStart"], r["NodeName"]) for r in rows if r.get("NodeName") and "DOWN" in r.get("State", "")
        )
        return list(dict.fromkeys(name for _, name in down))

    def memory_use(self, job_id: str) -> Optional[tuple[str, str]]:
        """(the highest MaxRSS of a task of the job's steps that ran out of memory, the memory the job asked for, as
        sacct writes them: ``154004K``, ``308M``); None where accounting does not say."""
        for _ in range(MEMORY_TRIES):  # a step that just ended: slurmdbd may not hold its MaxRSS yet
            proc = self.run("sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State,MaxRSS,ReqMem")
            if proc.returncode != 0:
                return None
            if (said := out_of_memory_peak(proc.stdout, job_id)) is not None:
                return said
            time.sleep(1.0)
        return None

    def qos_records(self, fields: Sequence[str]) -> Optional[list[dict[str, str]]]:
        """Every QOS in accounting, ``fields`` each (sacctmgr's names); None without a working slurmdbd."""
        return self._sacctmgr("qos", fields)

    def associations(self, user: str, fields: Sequence[str]) -> Optional[list[dict[str, str]]]:
        """The user's associations (account, partition, limits), ``fields`` each; None without accounting."""
        return self._sacctmgr("assoc", fields, "where", f"user={user}")

    def _sacctmgr(self, entity: str, fields: Sequence[str], *where: str) -> Optional[list[dict[str, str]]]:
        proc = self.run("sacctmgr", "-n", "-P", "show", entity, *where, f"format={','.join(fields)}")
        if accounting_failure(proc) is not None:
            return None
        lines = (line.split("|") for line in proc.stdout.splitlines() if line.strip())
        return [dict(zip(fields, values, strict=False)) for values in lines]


GATEWAY = SlurmGateway()
# The trainer's, on compute nodes: a rate-limited call is asked again for NODE_TIMEOUT_S at most, as a slow one.
NODE_GATEWAY = SlurmGateway(lambda cmd: run_command(cmd, NODE_TIMEOUT_S), NODE_TIMEOUT_S)


def gateway_for(runner: Optional[Runner] = None) -> SlurmGateway:
    """``GATEWAY``, or a gateway around ``runner``: tests hand in fabricated output this way."""
    return GATEWAY if runner is None else SlurmGateway(runner)
