"""Step 3 of the submission pipeline: the one renderer of sbatch scripts. It lays a resolved ``SlurmRequest`` out as
a batch script, and decides nothing itself.

- ``render(request, layout)``: the script ``ddpjob`` queues for one run (``Layout.run``), a sweep's array
  (``Layout.array``) or an adaptive search's workers (``Layout.workers``), and what ``--dry-run`` prints. Each task
  runs submitit's job entry on the job's folder, which calls the pickled task function (``jobs.submission.submit``);
  the folder's file layout (``%j_0_log.err``, ``%A_%a_...`` for arrays) is submitit's, so its ``SlurmJob`` reads the
  job's logs and results.
- ``render_template(request, run_dir)``: ``slurm_templates/ddp.sbatch`` with its marked blocks filled from the same
  request (``prepare --sbatch-script``, ``scripts/submit.sh``); everything else is kept as the user sees it there.

Both write the ``#SBATCH`` lines the same way (``directives``), from ``SlurmRequest.sbatch_options``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ddp_core import python_m
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.submission.request import SlurmRequest

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm_templates" / "ddp.sbatch"
# The module every submitit job runs: submitit's job entry (it loads FOLDER/<job id>_submitted.pkl and calls the
# function pickled there; submitit's job protocol), behind the check that no other user could have written that file.
TASK_ENTRY = "ddp_core.cluster.entry"
WCKEY = "submitit"  # submitit's: accounting reports group a user's submitit jobs by it


@dataclass(frozen=True)
class Layout:
    """Where a job's files go and what its batch script watches: one run's job, a sweep's array of runs, or a
    search's array of workers. Build one with ``run``, ``array`` or ``workers``."""

    folder: Path  # the job's folder: submitit's logs, the pickled call, the script
    watch: Optional[str] = None  # the run directory the batch script watches, as a shell word (None: none)
    batch_log: str = ""  # the batch script's own stderr, as a shell word (the watcher reads srun's report there)
    pick: Optional[str] = None  # an array's line that sets $RUN_DIR from its runs file
    count: Optional[int] = None  # an array's tasks
    parallelism: int = 0  # an array's tasks at once
    srun: bool = True  # False: the command runs in the batch step itself (a search's worker starts its own steps)

    @classmethod
    def run(cls, run_dir: Path) -> Layout:
        folder = run_dir / "slurm"
        return cls(folder, shlex.quote(str(run_dir)), shlex.quote(str(folder)) + '/"${SLURM_JOB_ID}_0_log.err"')

    @classmethod
    def array(cls, folder: Path, runs: Path, count: int, parallelism: int) -> Layout:
        """``runs``: a file with one run directory per line, task ``i``'s on line ``i + 1``: each task's batch script
        watches its own run's attempts."""
        log = shlex.quote(str(folder)) + '/"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}_0_log.err"'
        pick = f'RUN_DIR=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {shlex.quote(str(runs))})'
        return cls(folder, '"$RUN_DIR"', log, pick, count, parallelism)

    @classmethod
    def workers(cls, folder: Path, count: int) -> Layout:
        """A search's workers run their trials as srun steps of their own (``ddp_core.search.step``): no srun here,
        and no watcher (each step's failure is the worker's to handle)."""
        return cls(folder, count=count, parallelism=count, srun=False)


def directives(options: dict[str, Any]) -> list[str]:
    """``#SBATCH`` lines, sorted by option name: ``--name`` for True, else ``--name=VALUE`` (shell-quoted)."""
    lines = []
    for key in sorted(options):
        value, flag = options[key], key.replace("_", "-")
        lines.append(f"#SBATCH --{flag}" if value is True else f"#SBATCH --{flag}={shlex.quote(str(value))}")
    return lines


def task_command(request: SlurmRequest, layout: Layout) -> str:
    """What each task runs: submitit's job entry on the job's folder, behind the request's interpreter words (each
    rank's, with the prefix that holds the warning signal and the container's command); a command that runs in the
    batch step itself (a search's worker) runs on the batch script's interpreter, outside any image. ``python -m``
    in the form a user's ``submitit.py`` or ``ddp_core.py`` in the submit directory cannot shadow
    (``ddp_core.python_m``)."""
    python = list(request.task_python) if layout.srun else [request.host_python]
    return shlex.join([*python, "-u", *python_m.words(TASK_ENTRY), str(layout.folder)])


def render(request: SlurmRequest, layout: Layout) -> str:
    """The batch script of ``request`` in ``layout`` (see the module docstring)."""
    stdout, stderr = str(layout.folder / "%j_%t_log.out"), str(layout.folder / "%j_%t_log.err")
    options: dict[str, Any] = {"wckey": WCKEY}  # --signal among the request's options, where it has one
    if layout.count is not None:
        options["array"] = f"0-{layout.count - 1}%{min(layout.count, layout.parallelism)}"
        stdout, stderr = stdout.replace("%j", "%A_%a"), stderr.replace("%j", "%A_%a")
    options |= {"output": stdout.replace("%t", "0"), "error": stderr.replace("%t", "0"), "open-mode": "append"}
    options |= request.sbatch_options()
    setup = [*request.environment, *request.setup]
    if layout.watch is not None:
        setup = [*([layout.pick] if layout.pick else []), *request.watch_lines(layout.watch, layout.batch_log),
                 "ddpjob_begin", *setup]  # fmt: skip
    command = task_command(request, layout)
    if layout.srun:
        srun = ["srun", "--unbuffered", "--output", stdout, "--error", stderr, *request.srun_args]
        steps = "ddpjob_steps " if layout.watch is not None else ""  # again after a failure (SlurmRequest.watch_lines)
        command = f"{steps}{shlex.join(srun)} {command}"
    lines = ["#!/bin/bash", "", "# Parameters", *directives(options), "", "# setup", *setup]
    return "\n".join([*lines, "", "# command", "export SUBMITIT_EXECUTOR=slurm", command, ""])


def replace_block(text: str, name: str, lines: list[str]) -> str:
    start, end = f"# >>> ddpjob {name}\n", f"# <<< ddpjob {name}\n"
    head, sep, rest = text.partition(start)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise DdpJobError(f"sbatch template lacks the '{start.strip()}' ... '{end.strip()}' block", "restore it")
    return head + start + "".join(f"{line}\n" for line in lines) + end + tail


def render_template(request: SlurmRequest, run_dir: RunDir, template: Path = TEMPLATE) -> str:
    """``slurm_templates/ddp.sbatch`` for ``request``, its log in ``run_dir`` (see the module docstring)."""
    options = request.sbatch_options() | {"output": str(run_dir.slurm / "%j_batch.out"), "open-mode": "append"}
    text = replace_block(template.read_text(), "sbatch", directives(options))
    setup = [
        f"PYTHON=${{DDPJOB_PYTHON:-{shlex.quote(request.host_python)}}}",
        f"HOLD=({shlex.join(request.task_python[:-1])})",  # the prefix before the interpreter: see the srun line
        # The image's interpreter: the tasks run inside slurm.container's image, the batch script's own steps outside.
        *([f"TASK_PYTHON={shlex.quote(request.task_python[-1])}"] if request.container else []),
        f"SRUN_ARGS=({' '.join(shlex.quote(a) for a in request.srun_args)})",
        f"ENTRY={request.entry_module}",  # the srun line runs `python -m $ENTRY RUN_DIR`
        # `python -m`, unshadowed by a user's jobs.py or ddp_core.py in the submit directory (ddp_core.python_m).
        f"PYTHON_M=({shlex.join(python_m.RUN_MODULE)})",
        # RUN_DIR is set below; the trap reads it when the script exits (empty if it ended before that).
        *request.watch_lines(
            '"${RUN_DIR:-}"', '"${RUN_DIR:-}/slurm/${SLURM_JOB_ID}_batch.out"', '"$PYTHON" "${PYTHON_M[@]}"'
        ),
        *request.environment,  # the request's environment, then the config's slurm.setup lines
        *request.setup,
    ]
    return replace_block(text, "setup", setup)
