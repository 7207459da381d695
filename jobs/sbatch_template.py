"""Render ``slurm_templates/ddp.sbatch`` for a config: its marked #SBATCH and setup blocks are replaced
by lines derived from the config, everything else is kept as the user sees it in the template."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ddp_core import python_m
from ddp_core.config import Config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.request import SlurmRequest

TEMPLATE = Path(__file__).resolve().parent.parent / "slurm_templates" / "ddp.sbatch"


def sbatch_lines(request: SlurmRequest, run_dir: RunDir) -> list[str]:
    flags = request.sbatch_options()
    flags["output"] = str(run_dir.slurm / "%j_batch.out")
    flags["open-mode"] = "append"  # a requeued attempt would otherwise truncate the log
    lines = []
    for key in sorted(flags):
        value = flags[key]
        lines.append(f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={shlex.quote(str(value))}")
    return lines


def _replace_block(text: str, name: str, lines: list[str]) -> str:
    start, end = f"# >>> ddpjob {name}\n", f"# <<< ddpjob {name}\n"
    head, sep, rest = text.partition(start)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise DdpJobError(f"sbatch template lacks the '{start.strip()}' ... '{end.strip()}' block", "restore it")
    return head + start + "".join(f"{line}\n" for line in lines) + end + tail


def render(cfg: Config, run_dir: RunDir, python: str = sys.executable, template: Path = TEMPLATE) -> str:
    request = SlurmRequest.resolve(cfg, python=python, run_root=run_dir.path.parent)
    text = template.read_text()
    text = _replace_block(text, "sbatch", sbatch_lines(request, run_dir))
    setup = [
        f"PYTHON=${{DDPJOB_PYTHON:-{shlex.quote(python)}}}",
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
    return _replace_block(text, "setup", setup)
