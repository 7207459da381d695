"""Compute-node entry points: ``run`` (what submitit calls on every task) and ``main`` (``python -m ddp_core``).

Both build the ``DistEnv`` once, set up rank-prefixed logging, train, and leave through a clean exit path:
a failing rank logs its rank and error and exits non-zero at once (srun --kill-on-bad-exit ends the
others); a successful run meets at a barrier and destroys the process group before exiting.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from ddp_core.checkpoint import step_refs
from ddp_core.cluster import batch_node, exits, failures, oom_log, run_lock, signals
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.exits import ExitCode, after_submitit, leave, without_result
from ddp_core.cluster.log import log_failure, setup_logging
from ddp_core.cluster.preemption import StopFlag
from ddp_core.config import Config, load_config
from ddp_core.distributed import groups
from ddp_core.distributed.hints import failure_hint
from ddp_core.errors import DdpJobError
from ddp_core.run import snapshot
from ddp_core.run.rundir import RunDir
from ddp_core.trainer.watchdog import Watchdog, attempt_folder

if TYPE_CHECKING:
    from ddp_core.trainer.steps import Outcome

log = logging.getLogger("ddp_core")


def _train(cfg: Config, run_dir: RunDir, env: DistEnv, stop_flag: StopFlag) -> Outcome:
    from ddp_core.trainer.loop import Trainer  # torch is imported here, after logging and signal handlers are up

    trainer: Optional[Trainer] = None
    try:
        cfg = step_refs.resolve(cfg, run_dir)  # a pipeline step's ${steps.NAME.FIELD}: resolved as it starts
        oom_log.note_pid(run_dir.slurm, env)  # where the watcher looks if the kernel's OOM killer ends this rank
        snapshot.activate(run_dir)  # before the task's module is imported: the code that was submitted
        lock = None
        if env.is_main:
            lock = run_lock.hold(run_dir, env)  # the previous attempt may still be exiting, or dead
        # From before the rendezvous to the last step: a rank stuck anywhere in between is a hang.
        folder = attempt_folder(run_dir.hangs, env)
        on_hang = functools.partial(exits.after_hang, cfg, run_dir, env)
        watchdog = Watchdog(cfg.watchdog, folder, env.rank, env.world_size, on_hang).start()
        if env.slurm_job_id:
            from ddp_core.distributed import suspend  # torch, as train: imported by now

            suspend.on_change(watchdog.suspended)  # a suspended job makes no progress and is not hung
        try:
            trainer = Trainer(cfg, run_dir, env, stop_flag, watchdog)
            return trainer.fit()
        finally:
            watchdog.stop()
            if lock is not None:
                lock.close()
    except BaseException as err:
        log_failure(log, env, err, failure_hint(err))
        if isinstance(err, Exception):  # not a SystemExit or KeyboardInterrupt: those end the attempt on purpose
            failures.record(run_dir, env, err, trainer.at_step() if trainer is not None else None)
        raise


def _after_stop(cfg: Config, run_dir: RunDir, env: DistEnv, stop_flag: StopFlag, outcome: Outcome) -> int:
    if stop_flag.lost_batch_node is not None:  # rank 0's: the others stopped on its word, and leave it to decide
        return batch_node.requeue_after(stop_flag.lost_batch_node, cfg.slurm, run_dir, env, outcome.step)
    rerun = f"python -m ddp_core {run_dir.path}"
    at, deadline = stop_flag.received_at, stop_flag.by_deadline
    return exits.after_stop(cfg, run_dir, env, outcome.signum, outcome.step, rerun, at, deadline)


def _finish(cfg: Config, run_dir: RunDir, env: DistEnv, stop_flag: StopFlag, outcome: Outcome) -> int:
    code = 0
    if outcome.signum:
        code = _after_stop(cfg, run_dir, env, stop_flag, outcome)
    elif env.is_main and outcome.pruned:  # an adaptive sweep's pruner ended it early: done, not requeued
        run_dir.log_event("pruned", job_id=env.job_id, step=outcome.step)
    elif env.is_main:
        early = {"early_stopped": True} if outcome.early_stopped else {}  # train.early_stop_patience ended it
        run_dir.log_event("completed", job_id=env.job_id, step=outcome.step, final=outcome.final, **early)
    groups.teardown()  # its barrier also keeps every rank alive until rank 0 has requeued
    return code


@after_submitit
def run(run_dir: str) -> dict[str, float]:
    """Train the run in ``run_dir`` (created on the login node). Called by submitit on every task."""
    rd = RunDir(Path(run_dir))
    cfg = rd.load_config()
    stop_flag = StopFlag(cfg.slurm.warning, cfg.train.stop_check_ms / 1000)
    env = DistEnv.from_env()
    setup_logging(env)
    outcome = _train(cfg, rd, env, stop_flag)
    code = _finish(cfg, rd, env, stop_flag, outcome)
    signals.ignore_from_now(cfg.slurm.warning)  # submitit still writes its result before the process leaves
    if outcome.final is None:
        without_result(code)
    return outcome.final


def _run_dir_for(cfg: Config, env: DistEnv, explicit: Optional[str]) -> RunDir:
    if explicit:
        return RunDir(Path(explicit).resolve())
    # Every rank must derive the same directory without talking: key it on the launcher's job identity (a Slurm
    # job id, torchrun's --rdzv-id). A process started alone adds its pid (two started in the same second are two
    # runs). Only a named identity resumes when the same command is run again; else rerun with --run-dir.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id == "none" and not os.environ.get("SLURM_JOB_ID"):
        # torchrun --rdzv-backend c10d without --rdzv-id names every such launch "none" (one directory would pool
        # all of them), and nothing else its workers see is stable: MASTER_PORT is its agent's store, on a fresh
        # port each launch, so a rerun would not find its directory, and a port coming round again would resume an
        # unrelated run.
        raise DdpJobError(
            "torchrun was started with --rdzv-backend c10d but without --rdzv-id: this run has no identity to name "
            "its run directory by (torchrun calls every such run 'none')",
            f"add --rdzv-id NAME (the run directory is then {Path(cfg.run.root) / cfg.run.name}-NAME, and the same "
            "command run again resumes it), or give the directory with --run-dir DIR",
        )
    key = os.environ.get("SLURM_JOB_ID") or run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", key):  # a name inside run.root, never a path out of it
        raise DdpJobError(f"run id '{key}' cannot name a run directory", "use letters, digits, '.', '_' and '-'")
    return RunDir((Path(cfg.run.root) / f"{cfg.run.name}-{key}").resolve())


def _saved_config(target: str) -> Optional[Config]:
    """The config of the run directory ``target``; None for a YAML file, or where it cannot be read (``main``
    reports that, with the rank's logging)."""
    if not Path(target).is_dir():
        return None
    try:
        return RunDir(Path(target).resolve()).load_config()
    except DdpJobError:
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_core",
        description="Run the ddpjob trainer in this process (under srun, torchrun, or alone).",
    )
    parser.add_argument("target", help="a run directory, or a YAML config (a run directory is then created)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (only with a YAML config)")
    parser.add_argument("--run-dir", help="where to create the run directory for a YAML config")
    args = parser.parse_intermixed_args(argv)
    saved = _saved_config(args.target)  # read once: every rank of every attempt reads it before its first step
    if saved is not None and saved.script.enabled:
        # A run with a script section trains with that script (a hand-edited template may still say ddp_core).
        from ddp_core.script import mode as script

        leave(script.main([args.target]), exit_handlers=True)

    env = DistEnv.from_env()
    setup_logging(env)
    stop_flag: Optional[StopFlag] = None
    try:
        target = Path(args.target)
        if target.is_dir():
            if args.overrides:
                raise DdpJobError(
                    "overrides apply to a YAML config, not a run directory", "use `ddpjob resume RUN k=v`"
                )
            run_dir = RunDir(target.resolve())
            cfg = saved if saved is not None else run_dir.load_config()
        else:
            cfg = load_config(target, args.overrides)
            if cfg.script.enabled:
                raise DdpJobError(
                    "this config names a script: `python -m ddp_core` trains the built-in trainer",
                    "create its run directory with `ddpjob prepare`, then python -m ddp_core.script RUN",
                )
            run_dir = _run_dir_for(cfg, env, args.run_dir)
            if env.is_main:
                run_dir.initialize(cfg)
        stop_flag = StopFlag(cfg.slurm.warning, cfg.train.stop_check_ms / 1000)
    except DdpJobError as err:
        log.error("%s", err)
        return ExitCode.USAGE
    try:
        outcome = _train(cfg, run_dir, env, stop_flag)  # logs its own failure, naming the rank and host
    except BaseException:
        leave(ExitCode.FAILED)  # skip interpreter teardown: a half-open gloo group can abort (rc 134) or hang there
    try:
        code = _finish(cfg, run_dir, env, stop_flag, outcome)
    except BaseException as err:
        log.error(
            "rank %d/%d on %s failed after training, at step %d: %s: %s",
            env.rank,
            env.world_size,
            socket.gethostname(),
            outcome.step,
            type(err).__name__,
            err,
            exc_info=True,
        )
        leave(ExitCode.FAILED)
    leave(code)
