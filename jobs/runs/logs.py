"""``ddpjob logs`` (one rank's log of a run across all its attempts and jobs, optionally followed live) and
``ddpjob cancel``: the commands that act on a run's live jobs, which they find with one ``squeue`` call.

A requeued job appends each attempt to the same files (submitit's ``<job>_<rank>_log.err``, or the sbatch
template's srun ``--error``); a resumed run has a new job id and so new files. Files are shown in job order
with a header line each; attempts are told apart by the first line each attempt writes.
"""

from __future__ import annotations

import argparse
import codecs
import io
import itertools
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO, cast

from ddp_core.cluster.slurm import Runner, gateway_for
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from ddp_core.trainer.watchdog import cause
from jobs.runs import notes
from jobs.runs.listing import Job, query_ids, run_jobs, runs_to_show, shown_path
from jobs.runs.lookup import RUN_HELP, resolve

# The first line of an attempt: the trainer's or script mode's rank banner (stderr), submitit's start line (stdout),
# or the sbatch template's echo (batch log). Output before the first one (Slurm's own notes) belongs to attempt 1.
# With script.launcher=torchrun a task's log is its node's: the agent's banner starts the attempt, and the banners
# of the workers it started (source "torchrun") follow within it. Older logs name the trainer's banner's logger
# ddp_core.dist.groups (before ddp_core.distributed) or ddp_core.distributed (before ddp_core's packages).
ATTEMPT_START = re.compile(
    r"ddp_core\.(?:distributed\.groups|dist\.groups|distributed): \S+ on \S+: rank \d+/\d+ "
    r"|ddp_core\.script: (?!torchrun )\S+ on \S+: (?:rank \d+/\d+ |torchrun agent )"
    r"|submitit INFO \(.*\) - Starting with JobEnvironment|^ddpjob: job \S+ run directory "
)
POLL_S = 0.5


def log_file(job: Job, rank: int, stream: str) -> Path:
    if stream == "batch":
        return job.log_dir / f"{job.job_id}_batch.out"
    return job.log_dir / f"{job.job_id}_{rank}_log.{stream}"


def split_attempts(text: str) -> list[str]:
    """The text of each attempt in one log file, oldest first (one chunk if there is no marker)."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if ATTEMPT_START.search(line)][1:]
    bounds = [0, *starts, len(lines)]
    return ["".join(lines[a:b]) for a, b in itertools.pairwise(bounds)] or [""]


def header(job: Job, path: Path) -> str:
    return f"==> job {job.job_id}: {path} <=="


def _ensure_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def format_logs(files: list[tuple[Job, Path, str]], attempt: str) -> str:
    """``files`` (job, path, text) in job order; ``attempt``: ``all``, ``last`` or a 1-based number counted
    across all files (attempt 3 may be the first attempt of a resumed run's second job)."""
    chunks = [(job, path, chunk) for job, path, text in files for chunk in split_attempts(text)]
    if attempt == "all":
        out, shown = [], None
        for number, (job, path, chunk) in enumerate(chunks, 1):
            if path != shown:
                out.append(header(job, path) + "\n")
                shown = path
            if len(chunks) > 1:
                out.append(f"--- attempt {number} of {len(chunks)} ---\n")
            out.append(_ensure_newline(chunk))
        return "".join(out)
    number = len(chunks) if attempt == "last" else int(attempt)
    if not 1 <= number <= len(chunks):
        raise DdpJobError(f"--attempt {attempt}: the log has {len(chunks)} attempt(s)", "use 1..N, last or all")
    job, path, chunk = chunks[number - 1]
    return f"{header(job, path)}\n--- attempt {number} of {len(chunks)} ---\n{_ensure_newline(chunk)}"


def existing_logs(run: RunDir, rank: int, stream: str) -> list[tuple[Job, Path]]:
    return [(job, path) for job in run_jobs(run) if (path := log_file(job, rank, stream)).is_file()]


def _missing(run: RunDir, rank: int, stream: str) -> DdpJobError:
    jobs = run_jobs(run)
    if not jobs:
        return DdpJobError(f"run {run.name} has no jobs yet", "submit it (ddpjob submit / resume)")
    others = sorted({p.name for job in jobs for p in job.log_dir.glob(f"{job.job_id}_*_log.err")})
    hint = f"logs there: {', '.join(others)}" if others else "the job may still be queued: ddpjob status RUN, or -f"
    what = "batch log (sbatch template jobs only)" if stream == "batch" else f"rank {rank} {stream} log"
    return DdpJobError(f"no {what} for run {run.name}", hint)


def active_jobs(runs: Sequence[RunDir], runner: Optional[Runner] = None) -> dict[str, RunDir]:
    """The runs' jobs still queued or running, by job id (``5301_3`` for array tasks): one squeue call.
    squeue, not sacct: the queue's own view, with no accounting lag right after a submit."""
    owner = {job.job_id: run for run in runs for job in run_jobs(run)}
    ids = query_ids([job for run in runs for job in run_jobs(run)])
    if not ids:
        return {}
    active = {}
    for job_id, raw in gateway_for(runner).squeue_ids(ids):  # an array's id also lists other trials: keep ours
        if (run := owner.get(job_id) or owner.get(raw)) is not None:
            active[job_id] = run
    return active


def follow(
    run: RunDir,
    rank: int,
    stream: str,
    out: TextIO,
    active: Callable[[], bool],
    offsets: dict[Path, int],
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Print what is appended to the rank's log files, including files of jobs that appear later (a resume),
    until ``active()`` says no job of the run is left; ``offsets`` are the bytes already shown per file."""
    decoders: dict[Path, codecs.IncrementalDecoder] = {}
    while True:
        alive = active()  # asked before the last read, so output written before the job ended is never lost
        for job, path in existing_logs(run, rank, stream):
            if path not in offsets:
                out.write(header(job, path) + "\n")
                offsets[path] = 0
            with open(path, "rb") as f:
                f.seek(offsets[path])
                data = f.read()
            if data:
                offsets[path] += len(data)
                decoder = decoders.setdefault(path, codecs.getincrementaldecoder("utf-8")(errors="replace"))
                out.write(decoder.decode(data))
        out.flush()
        if not alive:
            return
        sleep(POLL_S)


def show(run: RunDir, rank: int, stream: str, attempt: str, out: TextIO, wait: bool = False) -> dict[Path, int]:
    """Print the selected attempt(s); returns the bytes shown per file (where ``follow`` goes on). No log yet
    is an error unless ``wait`` (following a job that has not started)."""
    found = existing_logs(run, rank, stream)
    if not found and not wait:
        raise _missing(run, rank, stream)
    data = {path: path.read_bytes() for _, path in found}
    if found:
        out.write(format_logs([(job, path, data[path].decode(errors="replace")) for job, path in found], attempt))
    return {path: len(content) for path, content in data.items()}


class SkipLines(io.TextIOBase):
    """A stream that drops the first ``lines`` lines written to it (``logs --skip-lines``: ``ddpjob --host``
    following again after a lost connection, without the lines it has shown)."""

    def __init__(self, out: TextIO, lines: int) -> None:
        self.out, self.left = out, lines

    def write(self, text: str) -> int:
        size = len(text)
        while self.left and text:
            end = text.find("\n")
            if end < 0:
                return size  # the rest of a skipped line: its end comes with the next write
            text, self.left = text[end + 1 :], self.left - 1
        if text:
            self.out.write(text)
        return size

    def flush(self) -> None:
        self.out.flush()


def cmd_logs(args: argparse.Namespace) -> int:
    run = RunDir(resolve(args.run_dir))
    if args.attempt not in ("all", "last") and not args.attempt.isdigit():
        raise DdpJobError(f"--attempt {args.attempt}: not a number", "use N (1 = first), last or all")
    out = cast(TextIO, SkipLines(sys.stdout, args.skip_lines)) if args.skip_lines else sys.stdout
    try:
        offsets = show(run, args.rank, args.stream, args.attempt, out, wait=args.follow and bool(active_jobs([run])))
        if args.follow:
            follow(run, args.rank, args.stream, out, lambda: bool(active_jobs([run])), offsets)
    except KeyboardInterrupt:  # the normal way out of -f
        pass
    except BrokenPipeError:  # `ddpjob logs RUN | head`: Python's recipe, so exiting does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    for e in run.events():  # hangs and failures after the log, where a reader's eye is
        if e["event"] == "hang":
            why = f"hung after step {e.get('step')}: {cause(str(e.get('summary', '')))}"
            print(f"ddpjob: attempt of job {e.get('job_id')} {why}", file=sys.stderr)
        elif e["event"] == "failure":
            print(f"ddpjob: attempt of job {e.get('job_id')}: {notes.failure_note(run.name, e)}", file=sys.stderr)
    return 0


def cancel(paths: Sequence[str], runner: Optional[Runner] = None) -> dict[str, RunDir]:
    """scancel every queued or running job of the runs under ``paths`` (one call); returns what it cancelled."""
    active = active_jobs([RunDir(p) for path in paths for p in runs_to_show(path)[0]], runner)
    active |= packs_queued(paths, runner)
    if active:
        proc = gateway_for(runner).cancel(list(active))
        if proc.returncode != 0:
            raise DdpJobError(f"scancel failed: {proc.stderr.strip()}", "check the job ids with squeue")
    return active


def packs_queued(paths: Sequence[str], runner: Optional[Runner] = None) -> dict[str, RunDir]:
    """The allocations of the packed sweeps among ``paths`` still queued or running, by array id: those that took
    no trial yet are no trial's job."""
    from jobs.sweeps.pack import recorded_packs

    sweeps = {Path(p).resolve(): recorded_packs(Path(p)) for p in paths if Path(p).is_dir()}
    packs = {job: root for root, jobs in sweeps.items() for job in jobs}
    listed = gateway_for(runner).squeue_ids(sorted(packs)) if packs else []
    return {job: RunDir(packs[job]) for job in packs if any(i.partition("_")[0] == job for i, _ in listed)}


def cmd_cancel(args: argparse.Namespace) -> int:
    cancelled = cancel(args.paths)
    for job_id, run in cancelled.items():
        print(f"cancelled {job_id}  {shown_path(run.path)}")
    if not cancelled:
        print("nothing to cancel: no job of these runs is queued or running")
    return 0


def add_parsers(sub: Any) -> None:
    """Register ``logs`` and ``cancel`` on ``ddpjob``'s subparsers."""
    p = sub.add_parser("logs", help="a run's rank log across its attempts and jobs")
    p.add_argument("run_dir", metavar="RUN", help=RUN_HELP)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the job ends")
    p.add_argument("--rank", type=int, default=0, help="which rank's log (default 0)")
    p.add_argument("--attempt", default="all", help="N (1 = first, across requeues and resumes), last or all")
    p.add_argument(
        "--stream",
        choices=("err", "out", "batch"),
        default="err",
        help="err: the trainer's log; out: stdout; batch: the sbatch script's own log",
    )
    p.add_argument("--skip-lines", type=int, default=0, metavar="N", help="leave out the first N lines of the output")

    p = sub.add_parser("cancel", help="scancel every queued or running job of runs or sweeps")
    p.add_argument("paths", nargs="+", metavar="RUN|SWEEP", help=f"runs ({RUN_HELP}) or sweep folders or names")


COMMANDS = {"logs": cmd_logs, "cancel": cmd_cancel}
