"""The fault storm (issue 56): one real run on the local cluster gets a seeded sequence of mixed faults, each injected
from outside its processes as the world does, at points the run itself reaches (tests/support/gated_tasks.py's
``StormDigitsTask``: rank 0 stops at gate I, once the test armed it, and waits for the test's go), never at a moment
raced by polling.

``plan(seed, faults)`` draws the schedule with ``random.Random(seed)``: the run's setting (which partition, spare
node, checkpoint store: a fault needs its setting, preemption a preemptible partition, a killed node a spare, an S3
stall a run that checkpoints there), then each fault's kind, target rank and gate (a count of rank 0's training
batches over the whole run). Some gates follow a restarting fault by two or three batches (the first steps after a
restart), a checkpoint-store fault lands as the next save is written (checkpoints every few steps, so the save comes
at once after the go), and a fault that requeues the job may be followed by a controller restart while the job is
pending. ``Storm.inject`` does one fault and waits until the run has recovered from it (a recorded event, never a
guessed time), and returns what the run recorded meanwhile, which ``check_recorded`` holds against what the fault
must cause. The same seed replays the same schedule: ``DDPJOB_STORM_SEED=N``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tests.support import cluster_guard
from tests.support.filesystems import fill
from tests.support.helpers import ROOT, events, task_pids, wait_for, wait_gone

LOCAL = str(ROOT / "scripts" / "slurm-local")
SMALL_FS = cluster_guard.HOME / "smallfs"
STEPS, EVERY = 60, 5  # train.max_steps and checkpoint.every_steps of every storm run
STALL_S = 10  # watchdog.stall_s: a short stall stays under it, a long one outlasts it
RUN = [
    "checkpoint.every_steps=5", "checkpoint.keep_last=3", "train.log_every=5",
    "train.eval_every=0", "wandb.mode=disabled", "slurm.nodes=2", "slurm.tasks_per_node=1",
    f"watchdog.stall_s={STALL_S}", "dist.timeout_s=120", "slurm.max_failures=30", "slurm.max_restarts=30",
    "slurm.max_preemptions=30", "slurm.max_hangs=30",
]  # fmt: skip
# The gated task (its gates: ``Schedule.overrides``), 50 ms a batch: the run still trains when a slow fault lands.
TASK = ["task.target=tests.support.gated_tasks:StormDigitsTask", "task.data.pause_s=0.05"]
# Where each setting runs: "low" is preemptible (no spare there), "wide" has the spare n3, "s3" checkpoints to S3.
SETTINGS = {
    "low": ["slurm.partition=low"],
    "wide": ["slurm.partition=wide", "slurm.spare_nodes=1"],
    "s3": ["slurm.partition=low"],
}
REQUEUES = {"stall_long", "usr2", "requeue", "preempt", "freeze_node"}  # the job goes through the queue
RESTARTS = REQUEUES | {"kill", "kill_node"}  # a new launch of the ranks follows
# kind -> the settings it can hit. (Not in "s3": the run directory on the small filesystem.)
KINDS = {
    "kill": {"low", "wide", "s3"},
    "stall_short": {"low", "wide", "s3"},
    "stall_long": {"low", "wide", "s3"},
    "usr2": {"low", "wide", "s3"},
    "requeue": {"low", "wide", "s3"},
    "preempt": {"low", "s3"},
    "freeze_node": {"wide"},
    "kill_node": {"wide"},
    "controller": {"low", "wide", "s3"},
    "accounting": {"low", "wide", "s3"},
    "disk_full": {"low", "wide"},
    "s3_stall": {"s3"},
}
ENDS = {"failed", "budget_exhausted", "preempted", "completed"}  # a run's last event
ONCE = {"freeze_node", "kill_node"}  # a node fault leaves no spare for a second one in the same allocation


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    gate: int  # rank 0's training batch, counted over the whole run (or the first once the gate is armed)
    rank: int  # the rank a process fault hits
    then_controller: bool = False  # a controller restart while the job is requeued and pending


@dataclass(frozen=True)
class Schedule:
    seed: int
    setting: str
    faults: tuple[Fault, ...]
    steps: int = STEPS  # train.max_steps

    def describe(self) -> str:
        items = [f"{f.index}:{f.kind}@{f.gate}" + (f"/rank{f.rank}" if f.kind in ("kill", "stall_short",
                 "stall_long") else "") + ("+controller" * f.then_controller) for f in self.faults]  # fmt: skip
        return f"seed {self.seed} ({self.setting}; replay: DDPJOB_STORM_SEED={self.seed}): " + ", ".join(items)

    def overrides(self) -> list[str]:
        gates = ",".join(str(f.gate) for f in self.faults)
        setting = SETTINGS[self.setting]
        return [*RUN, f"train.max_steps={self.steps}", *setting, *TASK, f"task.data.gates=[{gates}]"]


def plan(
    seed: int, count: int, kinds: set[str] | None = None, steps: int = STEPS, settings: set[str] | None = None
) -> Schedule:
    """``count`` faults drawn from ``kinds`` (default: all), for one of ``settings`` (default: all) that can take most
    of them; the last gate leaves two checkpoints' worth of steps, so every fault lands while the run still trains."""
    rng = random.Random(seed)
    setting = rng.choice(sorted(settings or SETTINGS))
    usable = sorted(k for k in (kinds or set(KINDS)) if setting in KINDS[k])
    room = steps - 2 * EVERY - 4
    gate, faults = rng.randint(4, 8), []
    for index in range(count):
        kind = rng.choice([k for k in usable if k not in ONCE or all(f.kind != k for f in faults)])
        then = kind in REQUEUES and rng.random() < 0.3
        faults.append(Fault(index, kind, gate, rng.randint(0, 1), then))
        after_restart = kind in RESTARTS and rng.random() < 0.5
        gate += rng.randint(2, 3) if after_restart else rng.randint(4, max(4, room // count))
    return Schedule(seed, setting, tuple(faults), steps)


@dataclass
class Recorded:
    """What the run recorded between a fault's injection and its recovery."""

    fault: Fault
    t: float
    seen: int  # the run's events before it
    events: list[dict[str, Any]] = field(default_factory=list)
    host: str = ""  # the node a node fault hit


def local(*args: str, timeout: float = 120) -> None:
    done = subprocess.run([LOCAL, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"slurm-local {' '.join(args)}: exit {done.returncode}: {done.stdout}{done.stderr}"


def begin(*args: str) -> Callable[[], None]:
    """``slurm-local ARGS`` started now; the returned call waits for it. A fault at a gate starts so and the go comes
    at once: rank 0 waiting out a slow command (slurmdbd's stop takes seconds) would look like a hang."""
    proc = subprocess.Popen([LOCAL, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def done() -> None:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"slurm-local {' '.join(args)}: exit {proc.returncode}: {out}"

    return done


def host_of(pid: int) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SLURMD_NODENAME="))


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def later(hold_s: float, *actions: Callable[[], None]) -> Callable[[], None]:
    """The ``actions`` once the fault has lasted ``hold_s`` (its length: the run is left alone meanwhile)."""

    def after() -> None:
        time.sleep(hold_s)
        for action in actions:
            action()

    return after


class Storm:
    """The injectors, for one job: ``inject`` waits at the fault's gate, does it, says go and waits out recovery."""

    def __init__(self, job_id: str, run_dir: Path, gate_dir: Path, s3_pid: int | None = None) -> None:
        self.job_id, self.run_dir, self.gate_dir, self.s3_pid = job_id, run_dir, gate_dir, s3_pid
        self.down: set[str] = set()  # nodes frozen or killed and not yet back
        self.stopped: list[int] = []  # processes SIGSTOPped

    def repair(self) -> None:
        """Whatever a fault left broken when the test stopped half-way: every process going again, the daemons up,
        the nodes back, the filesystem's space free."""
        signal_all([*self.stopped, *([self.s3_pid] if self.s3_pid else [])], signal.SIGCONT)
        for filler in [*SMALL_FS.glob(".storm-filler-*"), self.gate_dir / "slow"]:
            filler.unlink(missing_ok=True)
        for node in sorted(self.down):
            subprocess.run([LOCAL, "kill-node", node], capture_output=True, timeout=120)
            subprocess.run([LOCAL, "start-node", node], capture_output=True, timeout=120)
        for daemon in ("start-controller", "start-accounting"):
            subprocess.run([LOCAL, daemon], capture_output=True, timeout=120)

    def inject(self, fault: Fault, ends: bool = False) -> Recorded:
        """``fault`` at its gate, then the run's recovery from it; ``ends``: the fault spends a budget, so the run's
        ``budget_exhausted`` instead."""
        (self.gate_dir / f"arm-{fault.index}").touch()
        self.until((self.gate_dir / f"at-{fault.index}").exists, 240, f"gate {fault.index} (batch {fault.gate})")
        seen, starts = len(events(self.run_dir)), len(events(self.run_dir, "start"))
        record = Recorded(fault, time.time(), seen)
        after = getattr(self, fault.kind)(fault, record)
        (self.gate_dir / "slow").touch()  # the run trains on slowly while the fault is held
        (self.gate_dir / f"go-{fault.index}").touch()
        if after is not None:
            after()
        (self.gate_dir / "slow").unlink()
        if ends:
            wait_for(lambda: self.since(seen, "budget_exhausted"), 180, f"fault {fault.index}'s spent budget")
        elif fault.kind in REQUEUES:  # Slurm requeues the job itself after an `scontrol requeue`: no requeued event
            queued = "interrupted" if fault.kind == "requeue" else "requeued"
            self.until(lambda: self.since(seen, queued), 180, f"fault {fault.index} ({fault.kind})'s requeue")
            if fault.then_controller:
                self.controller_down(6)
        if fault.kind in RESTARTS and not ends:
            self.until(lambda: len(events(self.run_dir, "start")) > starts, 240, f"a launch after fault {fault.index}")
        record.events = events(self.run_dir)[seen:]
        return record

    def until(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """``wait_for``, failing at once with the run's last events if it ended meanwhile (failed, a budget spent)."""

        def met() -> Any:
            if value := condition():
                return value
            recorded = events(self.run_dir)
            if recorded and recorded[-1]["event"] in ENDS:
                raise AssertionError(f"the run ended while waiting for {what}: {recorded[-3:]}")
            return None

        return wait_for(met, timeout, what)

    def since(self, seen: int, kind: str = "requeued") -> bool:
        """Whether the run recorded a ``kind`` event after its first ``seen``."""
        return any(e["event"] == kind for e in events(self.run_dir)[seen:])

    def rank_pids(self, rank: int) -> list[int]:
        return wait_for(lambda: task_pids(self.job_id, rank), 30, f"rank {rank}'s process")

    def kill(self, fault: Fault, record: Recorded) -> None:
        signal_all(self.rank_pids(fault.rank), signal.SIGKILL)

    def stall_short(self, fault: Fault, record: Recorded) -> Callable[[], None]:
        pids = self.rank_pids(fault.rank)
        self.stopped += pids
        signal_all(pids, signal.SIGSTOP)
        return later(STALL_S / 3, lambda: signal_all(pids, signal.SIGCONT))

    def stall_long(self, fault: Fault, record: Recorded) -> Callable[[], None]:
        pids, hangs = self.rank_pids(fault.rank), len(events(self.run_dir, "hang"))
        self.stopped += pids
        signal_all(pids, signal.SIGSTOP)

        def after() -> None:
            self.until(lambda: len(events(self.run_dir, "hang")) > hangs, 120, "the watchdog's hang event")
            signal_all(pids, signal.SIGCONT)

        return after

    def usr2(self, fault: Fault, record: Recorded) -> None:
        subprocess.run(["scancel", "--signal=USR2", self.job_id], check=True, timeout=60)

    def requeue(self, fault: Fault, record: Recorded) -> None:
        subprocess.run(["scontrol", "requeue", self.job_id], check=True, timeout=60)

    def preempt(self, fault: Fault, record: Recorded) -> None:
        """Work in partition "high" that needs every CPU of both nodes (tests/cluster/test_slurm_preemption.py)."""
        hold = ["-N2", "--ntasks-per-node=1", "--cpus-per-task=4", "-o", "/dev/null", "--wrap", "sleep 2"]
        subprocess.run(["sbatch", "--parsable", "-p", "high", *hold], check=True, capture_output=True, timeout=60)

    def batch_host(self) -> str:
        shown = subprocess.run(["scontrol", "show", "job", self.job_id], capture_output=True, text=True, timeout=30)
        return next(w.split("=", 1)[1] for w in shown.stdout.split() if w.startswith("BatchHost="))

    def freeze_node(self, fault: Fault, record: Recorded) -> Callable[[], None]:
        """The batch node dies as the others see a dead host (its processes frozen); once the job is requeued it is
        killed and brought back (tests/support/helpers.py submit_and_lose_batch_node)."""
        record.host = self.batch_host()
        self.down.add(record.host)
        frozen = begin("freeze-node", record.host)

        def after() -> None:
            frozen()
            self.until(lambda: self.since(record.seen), 180, "the requeue after the frozen batch node")
            local("kill-node", record.host)
            local("start-node", record.host)
            self.down.discard(record.host)

        return after

    def kill_node(self, fault: Fault, record: Recorded) -> Callable[[], None]:
        """A rank's node dies whole (its slurmd and every process on it); the spare takes its place, and the node comes
        back once the ranks run again."""
        record.host = host_of(self.rank_pids(fault.rank)[0])
        starts = len(events(self.run_dir, "start"))
        self.down.add(record.host)
        killed = begin("kill-node", record.host)

        def after() -> None:
            killed()
            self.until(lambda: len(events(self.run_dir, "start")) > starts, 240, "the launch on the spare")
            local("start-node", record.host)
            self.down.discard(record.host)

        return after

    def controller_down(self, hold_s: float) -> None:
        local("stop-controller")
        time.sleep(hold_s)  # the fault's length: the run is left alone meanwhile
        local("start-controller")

    def controller(self, fault: Fault, record: Recorded) -> Callable[[], None]:
        return later(8, begin("stop-controller"), lambda: local("start-controller"))

    def accounting(self, fault: Fault, record: Recorded) -> Callable[[], None]:
        return later(10, begin("stop-accounting"), lambda: local("start-accounting"))

    def disk_full(self, fault: Fault, record: Recorded) -> Callable[[], None]:
        """The run directory's filesystem full (a log line or an event still fits) until a save fails for it."""
        failed = len(events(self.run_dir, "save_failed"))
        filler = fill(SMALL_FS, leave=64 * 1024, name=f".storm-filler-{fault.index}")

        def after() -> None:
            try:
                self.until(lambda: len(events(self.run_dir, "save_failed")) > failed, 120, "a save failed for space")
            finally:
                filler.unlink()

        return after

    def s3_stall(self, fault: Fault, record: Recorded) -> Callable[[], None]:
        assert self.s3_pid is not None
        os.kill(self.s3_pid, signal.SIGSTOP)
        return later(5, lambda: signal_all([self.s3_pid or 0], signal.SIGCONT))


FAILURE_KINDS = {"kill": "infrastructure", "freeze_node": "infrastructure", "kill_node": "infrastructure"}
INTERRUPTIONS = {"usr2": "preemption", "preempt": "preemption", "requeue": "terminated"}


def check_recorded(record: Recorded) -> list[str]:
    """What ``record`` shows that its fault must not cause: a failure of another kind (or of another rank, or host),
    a missing interruption or hang, a failure where none belongs."""
    kind, problems = record.fault.kind, []
    failures = [e for e in record.events if e["event"] == "failure"]
    want = FAILURE_KINDS.get(kind)
    if want is None and failures:
        problems.append(f"failures recorded for {kind}: {failures}")
    if want is not None:
        if not failures or any(f.get("kind") != want for f in failures):
            problems.append(f"{kind} must record {want} failures: {failures}")
        if kind == "kill" and not any(f.get("rank") == record.fault.rank for f in failures):
            problems.append(f"kill of rank {record.fault.rank} attributed to {[f.get('rank') for f in failures]}")
        if record.host and not any(f.get("host") == record.host for f in failures):
            problems.append(f"{kind} of {record.host} attributed to {[f.get('host') for f in failures]}")
    stops = [e.get("kind") for e in record.events if e["event"] == "interrupted"]
    if kind in INTERRUPTIONS and stops != [INTERRUPTIONS[kind]]:
        problems.append(f"{kind} must be interrupted as {INTERRUPTIONS[kind]}: {stops}")
    if kind == "stall_long" and not any(e["event"] == "hang" for e in record.events):
        problems.append("the long stall recorded no hang")
    return problems


def final_state(job_id: str, timeout: float) -> str:
    """The job's end as sacct has it: its last record's (a job that lost a node has a RESIZING record before)."""
    return wait_gone(job_id, timeout).split()[-1]


def lost_steps(run_dir: Path) -> list[str]:
    """Each later launch's start step against the newest checkpoint complete before it (a checkpoint row of
    metrics.jsonl, or the step an interruption saved): a resume from anything older lost steps."""
    logged = run_dir / "metrics.jsonl"  # none when no attempt got past its first log step's line
    rows = [json.loads(line) for line in logged.read_text().splitlines() if line.strip()] if logged.exists() else []
    saved = [(r["time"], r["step"]) for r in rows if r.get("split") == "checkpoint"]
    problems = []
    for start in events(run_dir, "start")[1:]:
        newest = max((step for t, step in saved if t < start["t"]), default=0)
        if start["step"] != newest:
            problems.append(f"launch at t={start['t']:.1f} started at step {start['step']}, newest save {newest}")
    return problems
