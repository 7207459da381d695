"""``python -m MODULE`` for the command lines ddpjob writes, without the working directory shadowing ddpjob.

Slurm starts a batch script and its srun tasks in the submit directory, and so do torchrun's workers; ``python -m``
puts that directory first on ``sys.path``, so a user's ``jobs.py``, ``ddp_core.py`` or ``submitit.py`` there would
be imported in place of ddpjob's own. ``python -P`` drops the directory, but it needs Python 3.11 (ddpjob supports
3.10, and a container's image brings its own interpreter), and a user's task module that lives in the submit
directory must still import as it did. So the command lines run ``python -c BOOT -m MODULE ARGS`` (``words``): BOOT
imports ``ddp_core`` and the module's top-level package with the directory off ``sys.path``, puts the directory back
first, as ``-m`` has it, and runs the module as ``-m`` does (``runpy``, ``sys.argv`` from the module on). The
packages stay loaded, so every later ``ddp_core.*`` or ``jobs.*`` import finds ddpjob's; the user's modules import
from the directory as before. MODULE's top-level name must be a package (``ddp_core``, ``jobs``, ``submitit``):
importing it runs only its ``__init__``. Interpreter options (``-u``) go before ``-c``; words between BOOT and ``-m``
are ignored (submitit appends ``-u -m submitit.core._submit``).

Imports nothing: ``jobs`` renders these words, ``ddp_core.script.torchrun`` starts its workers with them.
"""

from __future__ import annotations

# Double quotes inside: the shell quotes it in single quotes, as one readable word.
BOOT = (
    'import os,runpy,sys;del sys.path[0];i=sys.argv.index("-m");m=sys.argv[i+1];'
    '[__import__(p) for p in ("ddp_core",m.split(".")[0])];sys.path.insert(0,os.getcwd());'
    'sys.argv=sys.argv[i+1:];runpy.run_module(m,run_name="__main__",alter_sys=True)'
)

# What follows the interpreter (and its options) in place of ``-m``: the module's name and arguments come after.
RUN_MODULE = ("-c", BOOT, "-m")


def words(module: str) -> list[str]:
    """What follows the interpreter (and its options) for ``python -m MODULE``; the module's arguments come after."""
    return [*RUN_MODULE, module]
