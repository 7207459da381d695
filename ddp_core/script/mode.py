"""Script mode's compute-node launcher: ``python -m ddp_core.script RUN_DIR``, started once per Slurm task by srun.

It runs a user's own torchrun-style training script unchanged: it builds the rank's ``DistEnv`` once (from Slurm's
variables, torchrun's, or single-process defaults), exports torchrun's contract (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``,
``ROLE_NAME``, ``MASTER_ADDR``, ``MASTER_PORT``) plus ddpjob's own (``DDPJOB_RUN_DIR``, ``DDPJOB_CHECKPOINT_DIR``,
``DDPJOB_RESTART_COUNT``, ``DDPJOB_SIGNAL``), and runs the script in this process with ``runpy`` (``run_path`` for a
file, ``run_module`` for ``-m``), ``sys.argv`` being ``[script, *args]``. The script then calls
``dist.init_process_group()`` (env://) as it would under torchrun. ``ddp_core.runtime`` is its optional helper.

**Why in-process.** Slurm signals the processes of a step: the warning signal (``--signal=USR2@120``) and SIGTERM
must reach the Python process that trains, where ``ddp_core.runtime`` records them. A shell or a child process in
between would get them instead (a shell does not forward them; a parent would have to relay each one and mirror its
child's exit code), and ``srun --kill-on-bad-exit`` and the per-task logs would follow the wrong process. With
``runpy`` the srun task *is* the training process, like ``python train.py``: no shell, no child.

**Why it writes os.environ.** ``DistEnv`` stays read-only: it only reads the launcher's variables. This module is the
launcher, so building the script's environment is its job, as torchrun's agent does for its workers; and the script
runs in this process, so ``os.environ`` *is* its environment (``init_process_group``'s env:// rendezvous, libraries
that look for ``LOCAL_RANK``, the DataLoader workers it forks).

**Signals.** The task started with the warning signal and SIGTERM held (``ddp_core.cluster.signals``). While the script
runs, the warning signal stays held until the script or its framework installs a handler for it: a plain script (one
that never imports ``ddp_core.runtime``) is not killed by an early warning but runs on to the time limit, or, when it
resumes itself (``script.resume_args``), rank 0 requeues the job a moment after the warning (``signals.when_held``;
srun launcher), and a framework that handles Slurm's signal itself (Lightning's requeue on USR1) gets it, also one
that came before its handler was up, at an optimizer step every rank agrees on (``ddp_core.script.deferred``: a
handler that saves with collectives deadlocks when each rank runs it wherever the signal found it). SIGTERM keeps
its default (the process ends), released just before the script runs. Importing ``ddp_core.runtime`` replaces both
with handlers that record them.

**Exits.** The script returns (or ``sys.exit(0)``): rank 0 records ``completed``, exit 0. ``SystemExit`` with another
code: that code. An exception: ``rank R/W on HOST failed: ...`` is logged and the process exits 1 at once (``srun
--kill-on-bad-exit`` ends the others). ``runtime.requeue()`` exits by itself with the trainer's codes.

**``script.launcher: torchrun``.** The srun task is one per node instead, and ``_run`` hands it to
``ddp_core.script.torchrun``: a torchrun agent whose workers are ``python -m ddp_core.script RUN`` again, each of them
a rank as above (torchrun's variables come first in ``DistEnv.from_env``; ``TORCHELASTIC_RUN_ID`` tells a worker from
the agent).

**The config's ``script`` section** (``ddp_core.config.ScriptConfig``): its shape is checked at every load, the login
node checks the file and records its absolute path and sha256 (``ddp_core.script.prepare``), and the compute node
reads it back (``spec_from_config``). ``run(RUN_DIR)`` is what submitit calls on every task. This module imports no
torch.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import runpy
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Optional, Sequence

from ddp_core.checkpoint import step_refs
from ddp_core.cluster import exits, failures, health, oom_log, rendezvous, run_lock, signals
from ddp_core.cluster.env import DistEnv, process_started
from ddp_core.cluster.exits import ExitCode, after_submitit, leave, without_result
from ddp_core.cluster.log import log_failure, setup_logging
from ddp_core.cluster.preemption import back_in_queue
from ddp_core.cluster.slurm import NODE_GATEWAY
from ddp_core.config import ScriptConfig
from ddp_core.errors import DdpJobError
from ddp_core.run import snapshot
from ddp_core.run.rundir import RunDir
from ddp_core.script.deferred import DeferredWarning
from ddp_core.script.prepare import SCRIPT_HINT, sha256_of

if TYPE_CHECKING:
    from ddp_core.config import Config

log = logging.getLogger("ddp_core.script")


@dataclass(frozen=True)
class ScriptSpec:
    """What to run: a file (``path``, absolute) or a module (``module``), with its command-line arguments."""

    path: Optional[str]
    module: Optional[str]
    args: tuple[str, ...] = ()

    def describe(self) -> str:
        return self.path if self.path is not None else f"-m {self.module}"


def spec_from_config(
    script: ScriptConfig, where: str = "config.yaml", code: Optional[dict[str, Any]] = None, resumed: bool = False
) -> ScriptSpec:
    """Compute node: what the run's ``script`` section says to run, checked where the ranks run; with the run's code
    snapshot record ``code`` (``ddp_core.run.snapshot.activate``), the snapshot's copy of the script. ``resumed``:
    an attempt after the run's first, whose arguments end with ``script.resume_args``."""
    args = (*script.args, *script.resume_args) if resumed else tuple(script.args)
    if not script.enabled:
        raise DdpJobError(
            f"{where} has no script section (script.path or script.module): this run has no script to run",
            f"{SCRIPT_HINT}; a run without one trains with `python -m ddp_core RUN`",
        )
    if script.path is not None:
        if not Path(script.path).is_absolute():
            raise DdpJobError(
                f"{where}: 'script.path' must be an absolute path, not {script.path!r}",
                "ddpjob submit/prepare record it absolute; write the absolute path by hand",
            )
        path = snapshot.script_in_snapshot(code, script.path)
        if not Path(path).is_file():
            raise DdpJobError(
                f"script {path} does not exist on {socket.gethostname()}",
                "run directories and scripts must be on a filesystem every node sees",
            )
        if script.sha256 and sha256_of(Path(path), "script.path") != script.sha256:
            # Without a snapshot (--no-snapshot) a requeued attempt may run after the user edited the script.
            log.warning(
                "%s changed since it was submitted (sha256 %s...): running it as it is now", path, script.sha256[:12]
            )
        return ScriptSpec(path, None, args)
    return ScriptSpec(script.path, script.module, args)


def resumed_attempt(run_dir: RunDir, env: DistEnv) -> bool:
    """Whether an earlier attempt of the run started: the same answer on every rank, whenever rank 0 records this
    attempt's own start."""
    starts = [
        (e.get("job_id"), e.get("restart_count"), e.get("launch", 0)) for e in run_dir.events() if e["event"] == "start"
    ]
    return any(s != (env.job_id, env.restart_count, env.launch) for s in starts)


def read_script_spec(run_dir: RunDir) -> ScriptSpec:
    """The script a run trains with, from the ``script`` section of ``RUN/config.yaml``."""
    return spec_from_config(run_dir.load_config().script, str(run_dir.config_file), snapshot.read_record(run_dir))


def script_environment(
    env: DistEnv, run_dir: RunDir, warning_signal: str, init_timeout_s: float = 600.0
) -> dict[str, str]:
    """torchrun's variables for this rank, plus ddpjob's: what the script's process must see. A Slurm step's first
    rank picks the port its script will listen on (the derived one, else a free one) and publishes it, the others read
    it (``cluster.rendezvous``): a port another job holds never fails the run."""
    master_port = rendezvous.agree(env, run_dir.path, env.rank == 0, init_timeout_s)
    if env.source == "single" and not os.environ.get("MASTER_PORT"):
        # A lone process has no launcher to pick a port for it: a free one, so two runs on one host never collide.
        master_port = rendezvous.free_port()
    return {
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
        "GROUP_WORLD_SIZE": str(env.num_nodes),
        "ROLE_RANK": str(env.rank),  # one role ("default") holds every rank, as in a plain torchrun launch
        "ROLE_WORLD_SIZE": str(env.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(master_port),
        "DDPJOB_RUN_DIR": str(run_dir.path),
        "DDPJOB_CHECKPOINT_DIR": str(run_dir.checkpoints),
        "DDPJOB_RESTART_COUNT": str(env.restart_count),
        "DDPJOB_SIGNAL": warning_signal,
    }


def run_script(spec: ScriptSpec) -> None:
    """Run the script in this process as ``__main__``, as ``python PATH ARGS`` or ``python -m MODULE ARGS`` would."""
    if spec.path is not None:
        sys.argv = [spec.path, *spec.args]
        # `python train.py` puts the script's folder first on sys.path: its sibling modules import the same way.
        sys.path.insert(0, str(Path(spec.path).parent))
        runpy.run_path(spec.path, run_name="__main__")
    else:
        assert spec.module is not None
        sys.argv = [spec.module, *spec.args]  # run_module puts the module's file in argv[0], as -m does
        runpy.run_module(spec.module, run_name="__main__", alter_sys=True)


def _close_runtime(outcome: str) -> Optional[int]:
    """Close the helper's records with the attempt's outcome (if the script used it); the last step it logged."""
    runtime = sys.modules.get("ddp_core.script.runtime")
    if runtime is not None:
        runtime.finish(outcome)
    return runtime.last_step() if runtime is not None else None


def _completed(run_dir: RunDir, env: DistEnv) -> None:
    step = _close_runtime("finished")
    if not env.is_main:
        return
    if _requeued_meanwhile(env):
        # The script's framework requeued the job itself (Lightning on its SLURMEnvironment's signal) and then
        # returned: this attempt was interrupted, not the run completed.
        run_dir.log_event("requeued", kind="script", job_id=env.job_id, step=step)
        log.info("the script returned after job %s was requeued: its next attempt continues", env.slurm_job_id)
        return
    run_dir.log_event("completed", job_id=env.job_id, step=step, final=None)


def _requeued_meanwhile(env: DistEnv, tries: int = 3, pause_s: float = 0.3) -> bool:
    """Whether Slurm requeued this job during the attempt. When it does, it signals every process of the step, and a
    ``scontrol`` started in that moment dies with them (SIGTERM): asked again, briefly."""
    if not env.slurm_job_id:
        return False
    for attempt in range(tries):
        job = NODE_GATEWAY.show_job(env.slurm_job_id)
        if job is not None:
            return back_in_queue(job, env.restart_count)
        if attempt + 1 < tries:
            time.sleep(pause_s)
    return False


def _failed(run_dir: RunDir, env: DistEnv, err: BaseException) -> None:
    hint = ""
    if "torch.distributed" in sys.modules:  # a communication failure can only come from torch.distributed
        from ddp_core.distributed.hints import failure_hint  # torch: loaded by now

        hint = failure_hint(err)
    log_failure(log, env, err, hint)
    if isinstance(err, Exception):  # the batch script's watcher reads it (cluster.failures: user or infrastructure)
        failures.record(run_dir, env, err, None)
    _close_runtime("failed")  # leave() runs no atexit


@after_submitit
def run(run_dir: str) -> None:
    """Run the script of ``run_dir`` (created on the login node) as this task's rank: what submitit calls on every
    task, as ``ddp_core.launch.run`` for the trainer. Leaves with ``SystemExit`` for a non-zero code, so submitit
    writes no result for an attempt that did not finish."""
    # submitit's worker bypasses SIGTERM (it would keep a plain script running past its end): the default again.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if code := _run(run_dir):
        without_result(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_core.script",
        description="Run a run directory's training script (its config's script section) in this process, as "
        "torchrun would.",
    )
    parser.add_argument("run_dir", help="the run directory (config.yaml with a script section)")
    return _run(parser.parse_args(argv).run_dir)


def _start_logging(env: DistEnv) -> None:
    setup_logging(env)
    # Every rank's first line of every attempt, as the trainer's banner: `ddpjob logs` splits attempts at it.
    log.info(
        "%s on %s: rank %d/%d local %d/%d node %d/%d restart %d",
        env.source,
        socket.gethostname(),
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        env.node_rank,
        env.num_nodes,
        env.restart_count,
    )


def _run(run_dir_arg: str) -> int:
    env = DistEnv.from_env()
    try:
        run_dir = RunDir(Path(run_dir_arg).resolve())
        cfg = step_refs.resolve(run_dir.load_config(), run_dir)  # a pipeline step's ${steps.NAME.FIELD}: now
    except DdpJobError as err:
        _start_logging(env)
        log.error("%s", err)
        return ExitCode.USAGE
    if cfg.script.launcher == "torchrun" and "TORCHELASTIC_RUN_ID" not in os.environ:
        return _run_agent(run_dir, cfg, env)  # this process starts the node's ranks; each runs _run again
    _start_logging(env)
    try:
        oom_log.note_pid(run_dir.slurm, env)  # where the watcher looks if the kernel's OOM killer ends this rank
        record = snapshot.activate(run_dir)  # first on sys.path: the script's siblings / package as submitted
        spec = spec_from_config(cfg.script, str(run_dir.config_file), record, resumed_attempt(run_dir, env))
    except DdpJobError as err:
        log.error("%s", err)
        return ExitCode.USAGE
    os.environ.update(script_environment(env, run_dir, cfg.slurm.warning, cfg.dist.init_timeout_s))
    # One thread per core the rank was given, as the trainer does, unless the job says otherwise.
    os.environ.setdefault("OMP_NUM_THREADS", str(env.cpus_per_rank))
    warning = signals.warning_signal(cfg.slurm.warning)
    deferred = DeferredWarning(cfg, run_dir, env, functools.partial(_after_hang, cfg, run_dir, env))
    deferred.intercept()  # the script's own handler for it runs where every rank agrees (ddp_core.script.deferred)
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # a torchrun worker's agent warns for it
        deferred.arm_own_warnings()  # none by its time (cluster.deadline), or the batch node gone: ddpjob's own
    if env.is_main and env.slurm_job_id and cfg.script.resume_args:
        signals.when_held(warning, lambda: _requeue_held_warning(cfg, run_dir, env, warning))

    lock: Optional[IO[str]] = None
    try:
        health.check_node(run_dir, env, cfg.slurm.health_check)  # a bad node: this rank fails, srun ends the others
        if env.is_main:
            lock = run_lock.hold(run_dir, env)  # the previous attempt may still be exiting, or dead
            run_dir.log_event(
                "start",
                job_id=env.job_id,
                restart_count=env.restart_count,
                launch=env.launch,
                launched=process_started(),  # where this launch's start-up began (jobs.runs.goodput)
                step=None,
                world_size=env.world_size,
                nodes=env.num_nodes,  # what Slurm gave this attempt: an elastic job's varies
                script=spec.describe(),
            )
            log.info("running %s", shlex.join([spec.describe(), *spec.args]))
        signals.release(signal.SIGTERM)  # a plain script's default: it ends the process
        run_script(spec)
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)  # sys.exit("message"): what Python itself would do
            code = 1
    except BaseException as err:
        _failed(run_dir, env, err)
        leave(ExitCode.FAILED)  # skip interpreter teardown: a half-open gloo group can abort (rc 134) or hang there
    try:
        if code == 0:
            _completed(run_dir, env)
        else:
            log.warning("the script exited with code %d", code)
            _close_runtime("failed")
    except BaseException as err:
        _failed(run_dir, env, err)
        leave(ExitCode.FAILED)
    finally:
        deferred.close()
        if lock is not None:
            lock.close()
    signals.ignore_from_now(cfg.slurm.warning)  # the script's exit handlers still run before the process leaves
    return code


def _after_hang(cfg: Config, run_dir: RunDir, env: DistEnv, folder: Path, summary: str, step: Optional[int]) -> int:
    """The script's ranks stopped making progress after the warning signal (``DeferredWarning``'s watchdog): recorded
    and requeued within ``slurm.max_hangs`` as the trainer's hangs are, unless the script's own handler requeued the job
    already (Slurm then ends this attempt itself)."""
    if env.is_main and _requeued_meanwhile(env):
        log.warning("no progress after the warning signal, but the job is requeued already: Slurm ends this attempt")
        return ExitCode.REQUEUED
    return exits.after_hang(cfg, run_dir, env, folder, summary, step)


def _requeue_held_warning(cfg: Config, run_dir: RunDir, env: DistEnv, warning: signal.Signals) -> None:
    """A plain script that resumes itself got the warning signal and has no handler for it: rank 0 requeues the job
    now, within the run's budgets (``exits.after_stop``), rather than let the time limit end it. Slurm's SIGTERM then
    ends the script, and the next attempt continues from its own newest checkpoint with ``script.resume_args``."""
    log.warning(
        "the warning signal (%s) came and the script has no handler for it; it resumes itself (script.resume_args): "
        "requeueing the job",
        warning.name,
    )
    exits.after_stop(cfg, run_dir, env, warning, None, f"python -m ddp_core.script {run_dir.path}", time.time())


def _run_agent(run_dir: RunDir, cfg: Config, env: DistEnv) -> int:
    """``script.launcher: torchrun``: this node's torchrun agent (``ddp_core.script.torchrun``), its workers each a
    rank of this module."""
    from ddp_core.config import ranks_per_node

    setup_logging(env, label=f"agent node {env.node_rank}/{env.num_nodes}")
    # The attempt's first line in the node's log (its workers' banners follow): `ddpjob logs` splits attempts at it.
    log.info(
        "%s on %s: torchrun agent node %d/%d, %d ranks per node, restart %d",
        env.source,
        socket.gethostname(),
        env.node_rank,
        env.num_nodes,
        ranks_per_node(cfg),
        env.restart_count,
    )
    try:
        # Checked once here rather than by every worker: a missing script is one error line, not one per rank.
        spec_from_config(cfg.script, str(run_dir.config_file), snapshot.read_record(run_dir))
    except DdpJobError as err:
        log.error("%s", err)
        return ExitCode.USAGE
    from ddp_core.script.torchrun import run_agent

    warning = signals.warning_signal(cfg.slurm.warning)

    def requeue() -> None:
        # Rank 0's worker requeues the job itself where the warning reached it too (torchrun's module docstring).
        if not any(e["event"] in ("interrupted", "requeued") for e in failures.attempt_events(run_dir.events(), env)):
            _requeue_held_warning(cfg, run_dir, env, warning)

    resumes = env.is_main and env.slurm_job_id and cfg.script.resume_args  # node 0's agent, as rank 0 in srun mode
    return run_agent(run_dir.path, cfg, env, requeue if resumes else None)
