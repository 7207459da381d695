"""One allocation of a packed sweep: a pool of slots that run the sweep's trials side by side.

What submitit calls in the batch step of each of the pack's allocations: ``run`` for a grid or random sweep,
``run_search`` for an adaptive search. The allocation holds whole nodes; ``search.slots`` cuts them into slots of one
trial's size. Each slot takes the next trial from its source (``search.sources``: the sweep's queue, or the study,
each slot one of the search's workers, both under the search's ask-lock), runs it as a job step of its own on its node
(``search.step``: the trial's failures are retried there as a search's are, within the trial's budgets), tells the
source how it ended, and takes the next, until the source has no more. Every trial is a normal run directory.

Interruptions. The allocation's warning signal (or a preemption's) reaches every running step; each trial's rank 0
saves and, being packed, defers its requeue to the pool (``requeue_deferred``). The first deferral stops the pool:
no slot starts another trial, the signal is sent again to steps that started after it, and once every slot's step has
ended the pool requeues the allocation once (``requeued_by_batch`` in each deferred trial). The requeued allocation
(the same job id) takes those trials back first and resumes each from its checkpoint. A trial's hang is that trial's
alone: it runs again in its slot (within ``slurm.max_hangs``). SIGTERM (a cancel, the time limit) ends the pool: the
running trials stay claimed by this job, and a rerun of the sweep frees them for the next allocation.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from ddp_core.cluster import deadline, exits, preemption
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.slurm import NODE_GATEWAY
from ddp_core.run.rundir import RunDir
from ddp_core.search import queue, step
from ddp_core.search.slots import Slot, SlotSize, slots_here
from ddp_core.search.sources import QueueSource, Source, StudySource, Trial

log = logging.getLogger("ddp_core")
MARGIN_S = 60  # a trial is started only if it ends, by the median one's length, this long before the allocation
RESIGNAL_S = 10  # while the pool stops, how often steps that started after the warning signal get it again
REQUEUE_WAIT_S = 300  # Slurm ends a requeued job's batch step within seconds; past this the requeue did not happen


def outcome(run: RunDir) -> str:
    """How the trial's step left it: ``deferred`` (a requeue for the pool to make), ``hang`` (deferred after a hang),
    ``completed``, ``pruned`` or ``failed``."""
    events = [e for e in run.events() if e["event"] != "rank_failed"]
    last = events[-1] if events else {}
    if last.get("event") == "requeue_deferred":
        return "hang" if last.get("kind") == "hang" else "deferred"
    return str(last["event"]) if last.get("event") in ("completed", "pruned") else "failed"


class Pool:
    """The allocation's slots and what they share: where trials come from, the stop, the trials whose requeue it
    makes."""

    def __init__(self, pack: Mapping[str, Any], source: Source, environ: Mapping[str, str]) -> None:
        self.pack, self.source, self.env = pack, source, DistEnv.from_env(environ)
        self.job, self.env_end = str(environ.get("SLURM_JOB_ID", "")), environ.get(deadline.END_VAR)
        self.slots = slots_here(SlotSize.of(pack["slot"]), int(pack["per_node"]), environ)
        self.ending = threading.Event()  # SIGTERM: the job ends
        self.stopping = threading.Event()  # a trial deferred its requeue: no new trials, then one requeue
        self.lock = threading.Lock()
        self.held: set[str] = set()  # trials a slot of this allocation runs now
        self.busy: dict[int, bool] = {}
        self.deferred: list[RunDir] = []
        self.counts: dict[str, int] = {}
        self.lengths: list[float] = []  # the completed trials' run times here, seconds
        self.end: Optional[float] = None  # the allocation's scheduled end (read once, at the first trial that ended)
        self.out_of_time = False  # a slot left a trial that would not fit: the allocation is requeued for it

    def fits(self, now: float) -> bool:
        """Whether a trial started now ends, by the median length of the trials completed here, ``MARGIN_S`` before
        the allocation's end (unknown without one completed, or without an end: it fits). One that does not is left
        for the requeued allocation."""
        if not self.lengths:
            return True
        if self.end is None:
            job = None if self.env_end else NODE_GATEWAY.show_job(self.job)  # Slurm before 23.02: its EndTime
            self.end = deadline.job_end(job, self.env_end) or math.inf
        return now + statistics.median(self.lengths) + MARGIN_S < self.end

    def take(self, slot: Slot) -> Optional[Trial]:
        with self.lock:
            if self.ending.is_set() or self.stopping.is_set():
                return None
            if not self.fits(time.time()):
                if not self.out_of_time:
                    log.info("the next trial would not end before the allocation does: it is left for the requeue")
                self.out_of_time = True
                return None
            trial = self.source.take(slot, self.held)
            if trial is not None:
                self.held.add(trial.key)
            return trial

    def command(self, slot: Slot, run: RunDir) -> list[str]:
        logs = [f"--output={run.slurm}/%j_%t_log.out", f"--error={run.slurm}/%j_%t_log.err", "--open-mode=append"]
        return [*slot.srun(list(self.pack["step"]["srun"])), *logs, *self.pack["step"]["command"], str(run.path)]

    def serve(self, slot: Slot) -> None:
        """One slot's loop: the next trial, its step (again after its own hang), its end told to the source."""
        while (trial := self.take(slot)) is not None:
            run = trial.run
            if self.job not in {str(j["job_id"]) for j in run.jobs()}:
                run.record_job(self.job, "pack", log_dir=str(run.slurm), slot=slot.index)
            ended, code, began = "hang", 0, time.time()
            while ended == "hang" and not self.ending.is_set():
                log.info("%s: trial %s", slot.name, run.name)
                self.busy[slot.index] = True
                code = step.run(self.command(slot, run), run, self.ending, slot=slot)
                self.busy[slot.index] = False
                ended = outcome(run)
            if ended == "deferred":
                with self.lock:
                    self.deferred.append(run)
                self.stop(f"trial {run.name} deferred its requeue to the pack")
            elif not self.ending.is_set():
                self.source.settle(slot, trial, ended, code)
                with self.lock:
                    self.held.discard(trial.key)
                    self.counts[ended] = self.counts.get(ended, 0) + 1
                    self.lengths += [time.time() - began] if ended == "completed" else []
            log.info("%s: trial %s %s", slot.name, run.name, ended)

    def stop(self, why: str) -> None:
        if not self.stopping.is_set():
            log.info("stopping the pack: %s; the allocation is requeued once every slot's trial has saved", why)
            self.stopping.set()
            threading.Thread(target=self.resignal, daemon=True).start()

    def resignal(self) -> None:
        """The warning signal again, every ``RESIGNAL_S``, to steps that may have started after it, until every slot is
        idle: a trial that saved and deferred its requeue ignores it."""
        warning = str(self.pack.get("warning", "USR2"))
        while any(self.busy.values()) and not self.ending.is_set():
            time.sleep(RESIGNAL_S)
            if any(self.busy.values()):
                subprocess.run(["scancel", f"--signal={warning}", self.job], capture_output=True, timeout=60)

    def requeue(self) -> None:
        """The one requeue of the allocation the deferred trials asked for, recorded in each of them."""
        refused = preemption.requeue(self.env, NODE_GATEWAY)
        for run in self.deferred:
            last = run.events()[-1]
            kind, at = last.get("kind"), last.get("step")
            if refused is None:
                run.log_event("requeued_by_batch", kind=kind, job_id=self.env.job_id, step=at)
            else:
                exits.requeue_refused(run, self.env, kind, at, refused.why, "the pack could not requeue its allocation")
        if refused is None:
            time.sleep(REQUEUE_WAIT_S)  # Slurm ends this batch step; the requeued allocation starts the pool again
            raise RuntimeError(f"job {self.job} asked for its requeue, but Slurm did not requeue it")


def run(sweep_dir: str, generation: int = 0) -> dict[str, int]:
    """A packed grid or random sweep's allocation (its batch step): every slot serves the sweep's queue."""
    sweep = Path(sweep_dir)
    return serve(queue.read_pack(sweep), QueueSource(sweep, os.environ.get("SLURM_JOB_ID", "")), generation)


def run_search(sweep_dir: str, generation: int) -> dict[str, int]:
    """A packed adaptive search's allocation: every slot is one of the search's workers."""
    from ddp_core.search.study import read_spec

    sweep, task = Path(sweep_dir), int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))
    spec = read_spec(sweep)
    return serve({**spec["pack"], "step": spec["step"]}, StudySource(sweep, generation, task), generation)


def serve(pack: Mapping[str, Any], source: Source, generation: int) -> dict[str, int]:
    """The pool's slots until the source has no more for them, or the pack stops; then the one requeue, if any."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pack %(message)s")
    pool = Pool(pack, source, os.environ)
    signal.signal(signal.SIGTERM, lambda *_: pool.ending.set())  # replaces submitit's, which only logs it
    log.info("job %s (generation %d): %d slots of %s", pool.job, generation, len(pool.slots), pool.slots[0].size)
    threads = [threading.Thread(target=pool.serve, args=(slot,), name=slot.name) for slot in pool.slots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if (pool.deferred or (pool.out_of_time and source.pending(pool.job))) and not pool.ending.is_set():
        pool.requeue()
    log.info("job %s: %s", pool.job, pool.counts or "nothing left to run")
    return pool.counts
