"""What every task of a ddpjob batch script runs: submitit's job entry (``submitit.core._submit FOLDER``: it loads
``FOLDER/<job id>_submitted.pkl`` and calls the function pickled there), behind the run's permission policy
(``ddp_core.run.permissions``). First this process's umask is tightened, so the result submitit pickles is writable
by no one else; then the pickled call is checked, with its folder up to the run directory (or the sweep's): a file
another user owns or can write is refused in one line before submitit unpickles it (it would run their code as you),
and recorded as the rank's user error (``record_refusal``), so the job ends FAILED at once rather than requeued.

``python -m ddp_core.run.entry FOLDER`` (``jobs.submission.render``'s task command); standard library and submitit
only, as submitit's own entry, until a refusal is recorded.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ddp_core.errors import DdpJobError
from ddp_core.run import permissions

WAIT_S = 60  # submitit's own wait for the pickled call (the login node moves it in place after sbatch answers)


def _import_submitit() -> None:
    """submitit's modules, imported with the submit directory off ``sys.path`` as ``ddp_core.python_m``'s BOOT imports
    a module's own package: a user's ``submitit.py`` there must not stand in for it."""
    first = sys.path.pop(0) if sys.path and sys.path[0] == os.getcwd() else None
    try:
        import submitit.core.job_environment
        import submitit.core.submission  # noqa: F401
    finally:
        if first is not None:
            sys.path.insert(0, first)


def submitted_pickle(folder: Path) -> Path:
    """This task's pickled call, named as submitit's job entry names it (the job id, an array task's included)."""
    os.environ["SUBMITIT_FOLDER"] = str(folder)  # as submitit's process_job sets it
    from submitit.core.job_environment import JobEnvironment

    return Path(JobEnvironment().paths.submitted_pickle)


def check(folder: Path) -> None:
    """Tighten the umask, then refuse (exit 2, one line) a pickled call another user owns or can write, or a folder
    of it up to the run directory (or the sweep's) that they can write."""
    permissions.tighten(permissions.is_private())
    pickle = submitted_pickle(folder)
    deadline = time.monotonic() + WAIT_S
    while not pickle.exists() and time.monotonic() < deadline:
        time.sleep(1)
    try:
        permissions.check_trusted([pickle] if pickle.exists() else [folder], top=folder.parent)
    except DdpJobError as err:
        print(f"ddpjob: error: {err}", file=sys.stderr, flush=True)
        record_refusal(folder.parent, err)
        raise SystemExit(2) from None


def record_refusal(run: Path, err: DdpJobError) -> None:
    """The refusal as this rank's ``rank_failed`` event, a user error: the batch script's watcher then ends the job
    FAILED at once with this line, where a requeue would only be refused again. A sweep's folder (no ``config.yaml``:
    its trials' run directories are below it) records nothing; the watcher reads srun's exit there."""
    if not (run / "config.yaml").is_file():
        return
    from ddp_core.cluster.env import DistEnv
    from ddp_core.cluster.failures import record
    from ddp_core.run.rundir import RunDir

    record(RunDir(run), DistEnv.from_env(), err, None)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    _import_submitit()
    if args and not args[0].startswith("-"):  # the job's folder (--help: submitit's own parser answers)
        check(Path(args[0]).resolve())
    from submitit.core.submission import submitit_main

    sys.argv = [sys.argv[0], *args]
    submitit_main()


if __name__ == "__main__":
    main()
