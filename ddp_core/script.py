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

**Signals.** Before the script runs, the warning signal is ignored: a plain script (one that never imports
``ddp_core.runtime``) runs on to the time limit instead of being killed by an early warning, and SIGTERM keeps its
default (the process ends). Importing ``ddp_core.runtime`` replaces both with handlers that record them.

**Exits.** The script returns (or ``sys.exit(0)``): rank 0 records ``completed``, exit 0. ``SystemExit`` with another
code: that code. An exception: ``rank R/W on HOST failed: ...`` is logged and the process exits 1 at once (``srun
--kill-on-bad-exit`` ends the others). ``runtime.requeue()`` exits by itself with the trainer's codes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import shlex
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional, Sequence

from ddp_core.dist_env import DistEnv
from ddp_core.errors import DdpJobError
from ddp_core.log import setup_logging
from ddp_core.rundir import RunDir

log = logging.getLogger("ddp_core.script")

SCRIPT_FILE = "script.json"  # until the config has a `script` section: {"path" | "module", "args"}
_SPEC_HINT = 'write {"path": "/abs/train.py", "module": null, "args": [...]} (or "module": "pkg.train", "path": null)'


@dataclass(frozen=True)
class ScriptSpec:
    """What to run: a file (``path``, absolute) or a module (``module``), with its command-line arguments."""

    path: Optional[str]
    module: Optional[str]
    args: tuple[str, ...] = ()

    def describe(self) -> str:
        return self.path if self.path is not None else f"-m {self.module}"


def read_script_spec(run_dir: RunDir) -> ScriptSpec:
    """The script a run trains with, from ``RUN/script.json``: the one place that knows where the spec lives."""
    path = run_dir.path / SCRIPT_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DdpJobError(f"{path} does not exist: this run has no script to run", _SPEC_HINT) from None
    except (OSError, ValueError) as err:
        raise DdpJobError(f"{path} is unreadable ({err})", _SPEC_HINT) from None
    if not isinstance(raw, dict):
        raise DdpJobError(f"{path} holds {type(raw).__name__}, not an object", _SPEC_HINT)
    unknown = sorted(set(raw) - {"path", "module", "args"})
    if unknown:
        raise DdpJobError(f"{path} has unknown keys {unknown}", _SPEC_HINT)
    script, module, args = raw.get("path"), raw.get("module"), raw.get("args", [])
    if (script is None) == (module is None):
        raise DdpJobError(f"{path} must name exactly one of 'path' and 'module'", _SPEC_HINT)
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise DdpJobError(f"{path}: 'args' must be a list of strings", _SPEC_HINT)
    if script is not None:
        if not isinstance(script, str) or not Path(script).is_absolute():
            raise DdpJobError(f"{path}: 'path' must be an absolute path, not {script!r}", _SPEC_HINT)
        if not Path(script).is_file():
            raise DdpJobError(f"script {script} does not exist on {socket.gethostname()}",
                              "run directories and scripts must be on a filesystem every node sees")  # fmt: skip
    elif not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
        raise DdpJobError(f"{path}: 'module' must be a dotted module name, not {module!r}", _SPEC_HINT)
    return ScriptSpec(script, module, tuple(args))


def script_environment(env: DistEnv, run_dir: RunDir, warning_signal: str) -> dict[str, str]:
    """torchrun's variables for this rank, plus ddpjob's: what the script's process must see."""
    master_port = env.master_port
    if env.source == "single" and not os.environ.get("MASTER_PORT"):
        # A lone process has no launcher to pick a port for it: a free one, so two runs on one host never collide.
        master_port = _free_port()
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def _completed(run_dir: RunDir, env: DistEnv) -> None:
    runtime = sys.modules.get("ddp_core.runtime")  # loaded only if the script used the helper
    step = None
    if runtime is not None:
        runtime.finish()
        step = runtime._state.last_step
    if env.is_main:
        run_dir.log_event("completed", job_id=env.job_id, step=step, final=None)


def _failed(env: DistEnv, err: BaseException) -> None:
    hint = ""
    if "torch.distributed" in sys.modules:  # a communication failure can only come from torch.distributed
        from ddp_core.launch import _hint

        hint = _hint(err)
    log.error("rank %d/%d on %s failed: %s: %s%s", env.rank, env.world_size, socket.gethostname(),
              type(err).__name__, err, hint, exc_info=True)  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_core.script",
        description="Run a run directory's training script (RUN/script.json) in this process, as torchrun would.",
    )
    parser.add_argument("run_dir", help="the run directory (config.yaml, script.json)")
    args = parser.parse_args(argv)

    env = DistEnv.from_env()
    setup_logging(env)
    try:
        run_dir = RunDir(Path(args.run_dir).resolve())
        cfg = run_dir.load_config()
        spec = read_script_spec(run_dir)
    except DdpJobError as err:
        log.error("%s", err)
        return 2
    os.environ.update(script_environment(env, run_dir, cfg.slurm.signal))
    # One thread per core the rank was given, as the trainer does, unless the job says otherwise.
    os.environ.setdefault("OMP_NUM_THREADS", str(env.cpus_per_rank))
    warning = signal.Signals[f"SIG{cfg.slurm.signal.upper().removeprefix('SIG')}"]
    signal.signal(warning, signal.SIG_IGN)  # until ddp_core.runtime takes it over (see the module docstring)

    lock: Optional[IO[str]] = None
    try:
        if env.is_main:
            # The previous attempt of this Slurm job may still be exiting when its requeued successor starts.
            holder = {"host": socket.gethostname(), "pid": os.getpid(), "job": env.job_id or "-"}
            lock = run_dir.hold_trainer_lock(holder, wait_s=60.0 if env.restart_count else 0.0)
            run_dir.log_event("start", job_id=env.job_id, restart_count=env.restart_count, step=None,
                              world_size=env.world_size, script=spec.describe())  # fmt: skip
            log.info("running %s", shlex.join([spec.describe(), *spec.args]))
        run_script(spec)
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)  # sys.exit("message"): what Python itself would do
            code = 1
    except BaseException as err:
        _failed(env, err)
        logging.shutdown()
        os._exit(1)  # skip interpreter teardown: a half-open gloo group can abort (rc 134) or hang there
    try:
        if code == 0:
            _completed(run_dir, env)
        else:
            log.warning("the script exited with code %d", code)
    except BaseException as err:
        _failed(env, err)
        logging.shutdown()
        os._exit(1)
    finally:
        if lock is not None:
            lock.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
