"""The config sections of ddpjob's features besides training: ``script`` (script mode), ``snapshot`` (the code
snapshot), ``watchdog`` (hangs) and ``trial`` (a run bound to an adaptive sweep's trial), each with its checks.

Declared here, in the torch-free config package, so the schema imports nothing above it; the code that acts on a
section (``ddp_core.script``, ``ddp_core.run.snapshot``, ``ddp_core.trainer.watchdog``, ``ddp_core.search``)
imports its dataclass from here.

**Sweeps over script arguments.** A sweep key ``script.args.NAME`` (``ddpjob sweep ... script.args.lr=1e-4,3e-4``)
is one argument of each trial's script, not a config key: ``with_swept_args`` turns a trial's values into its
``script.args`` on the login node (``--NAME=VALUE`` after the fixed arguments; ``NAME=VALUE`` with
``script.arg_style: hydra``), so the trial's config.yaml holds the exact command line its ranks run. The sweep
(``jobs/sweeps/spec.py``, ``ddp_core.config.trials``) calls it; the syntax of those keys and values is defined here
only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Mapping, Optional

from ddp_core.config.schema import SlurmConfig
from ddp_core.errors import DdpJobError

# How a swept script.args.NAME=VALUE key is written into the script's arguments (script.arg_style).
ARG_STYLES = {"flag": "--{name}={value}", "hydra": "{name}={value}"}
LAUNCHERS = ("srun", "torchrun")
SWEPT_ARG_PREFIX = "script.args."
# An option name (argparse: --save-every, --lr); with hydra, a dotted key (optim.lr, model.n_layers).
_FLAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_HYDRA_NAME = re.compile(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*")


@dataclass
class ScriptConfig:
    """The config's ``script`` section: a torchrun-style script that trains instead of the built-in trainer
    (docs/script-mode.md)."""

    # Script mode: the .py file run instead of the built-in trainer (`ddpjob submit --script train.py`); the login
    # node makes it absolute at submit (relative to where ddpjob runs).
    path: Optional[str] = None
    # Script mode: or a module, run as `python -m MODULE`: it must be importable from the job's environment. One of
    # script.path and script.module.
    module: Optional[str] = None
    # The script's command-line arguments, passed as they are (sys.argv[1:]; `ddpjob submit --script train.py --
    # ARGS`). Sweeps append one per swept script.args.NAME key.
    args: List[str] = field(default_factory=list)
    # Appended to script.args on every attempt after the run's first (a requeue, a `ddpjob resume`), for a script that
    # saves its own checkpoints: [--init_from=resume] (nanoGPT), [--resume_from_checkpoint=True] (a HF Trainer script).
    resume_args: List[str] = field(default_factory=list)
    # Recorded at submit: sha256 of the script's content, so a run names exactly what it trained with (not set by
    # hand).
    sha256: Optional[str] = None
    # Sweeps: how a swept script.args.NAME=VALUE is passed, `--NAME=VALUE` (flag) or `NAME=VALUE` (hydra).
    arg_style: str = "flag"
    # How the ranks start: "srun" (one Slurm task per rank, each task runs the script) or "torchrun" (one Slurm task
    # per node runs torchrun's agent, which starts the node's ranks: ddp_core.script.torchrun). See
    # docs/script-mode.md, "Launcher".
    launcher: str = "srun"

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.module is not None

    def command(self) -> list[str]:
        """What each rank runs, as a command line: ``[PATH, *args]`` or ``["-m", MODULE, *args]``."""
        return [*([self.path] if self.path is not None else ["-m", str(self.module)]), *self.args]


def validate_script(script: ScriptConfig, slurm: Optional[SlurmConfig] = None) -> None:
    """Shape checks at every load (login and compute node): nothing here touches the filesystem. With ``slurm``, also
    the combinations of ``script.launcher`` and ``slurm.*`` that cannot work."""
    if script.path is not None and script.module is not None:
        raise DdpJobError(
            "config keys 'script.path' and 'script.module' are both set: a run has one script",
            "keep one of them (set the other to null)",
        )
    module = script.module
    if module is not None and not all(part.isidentifier() for part in module.split(".")):
        raise DdpJobError(
            f"config key 'script.module' = {module!r} is invalid: must be a dotted module name",
            "e.g. script.module=mypkg.train (what `python -m` takes)",
        )
    if script.path is not None and not script.path.strip():
        raise DdpJobError("config key 'script.path' is empty", "give the .py file, or null for the built-in trainer")
    if script.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", script.sha256):
        raise DdpJobError(
            f"config key 'script.sha256' = {script.sha256!r} is invalid: not a sha256 hex digest",
            "leave it out: ddpjob records it at submit",
        )
    for key in ("args", "resume_args"):
        if getattr(script, key) and not script.enabled:
            raise DdpJobError(f"config key 'script.{key}' is set but no script is", "set script.path or script.module")
    if script.arg_style != "flag" and not script.enabled:
        raise DdpJobError("config key 'script.arg_style' is set but no script is", "set script.path or script.module")
    if script.arg_style not in ARG_STYLES:
        raise DdpJobError(
            f"config key 'script.arg_style' = {script.arg_style!r} is invalid: must be one of {', '.join(ARG_STYLES)}",
            "flag: a swept script.args.NAME becomes --NAME=VALUE (argparse); hydra: NAME=VALUE",
        )
    _validate_launcher(script, slurm)


def _validate_launcher(script: ScriptConfig, slurm: Optional[SlurmConfig]) -> None:
    if script.launcher not in LAUNCHERS:
        raise DdpJobError(
            f"config key 'script.launcher' = {script.launcher!r} is invalid: must be one of {', '.join(LAUNCHERS)}",
            "srun: one Slurm task per rank (the default); torchrun: one torchrun agent per node starts its ranks",
        )
    if script.launcher != "srun" and not script.enabled:
        raise DdpJobError(
            f"config key 'script.launcher' = {script.launcher!r} is set but no script is",
            "set script.path or script.module (the built-in trainer always runs one Slurm task per rank)",
        )
    if script.launcher == "torchrun" and slurm is not None and slurm.gpus_per_node and slurm.gpu_bind == "task":
        # --gpus-per-task would give the node's one task (the agent) only gpus_per_node / ranks GPUs to share.
        raise DdpJobError(
            "config keys 'script.launcher' = 'torchrun' and 'slurm.gpu_bind' = 'task' cannot be combined: the node's "
            "one task (torchrun's agent) must see all of the node's GPUs",
            "set slurm.gpu_bind=node (each rank takes cuda:LOCAL_RANK), or script.launcher=srun",
        )


@dataclass
class SnapshotConfig:
    """The config's ``snapshot`` section: copy the user's code into the run directory at submit
    (docs/snapshots.md)."""

    # Copy the code into RUN/code at submit; every attempt imports the copy. false (or `--no-snapshot`): every
    # attempt imports the code as it is when it starts.
    enabled: bool = True
    # Refuse a snapshot larger than this, in MB (data or outputs inside the code's folder, most often).
    max_mb: float = 50.0
    max_files: int = 5000  # refuse a snapshot of more files than this
    # Outside git, also copy hidden files and folders (.env, .netrc, a home's .bash_history): they are left out
    # unless this is true. `ddpjob submit --dry-run` lists what would be copied and what is left out.
    include_hidden: bool = False
    # Also copy what a symlink points at outside the code's folder (a link to ~/.aws/credentials): left out
    # unless this is true, in git or not.
    outside_links: bool = False


def validate_snapshot(snapshot: SnapshotConfig) -> None:
    if not snapshot.max_mb > 0:
        raise DdpJobError(
            f"config key 'snapshot.max_mb' = {snapshot.max_mb!r} is invalid: must be > 0",
            "e.g. snapshot.max_mb=200, or snapshot.enabled=false (--no-snapshot) to take none",
        )
    if snapshot.max_files < 1:
        raise DdpJobError(
            f"config key 'snapshot.max_files' = {snapshot.max_files!r} is invalid: must be >= 1",
            "e.g. snapshot.max_files=20000, or snapshot.enabled=false (--no-snapshot) to take none",
        )


@dataclass
class WatchdogConfig:
    """The config's ``watchdog`` section: a rank that stops progressing is a hang (docs/hangs.md)."""

    # No progress (a finished step or eval batch) for this long is a hang: stacks are dumped, the job requeued
    # (docs/hangs.md). Keep it below dist.timeout_s, or the collective times out first and the job fails instead.
    # Script mode: only after the warning signal, capped at slurm.signal_lead_s / 2 (docs/script-mode.md).
    # 0: no watchdog.
    stall_s: float = 300.0
    # The allowance before the attempt's first step (imports, rendezvous, datasets, resume), during evaluations
    # and for a checkpoint save.
    first_step_s: float = 1800.0


def validate_watchdog(cfg: WatchdogConfig, collective_timeout_s: float) -> None:
    """Login-node checks, with the config tree's message style."""
    for key in ("stall_s", "first_step_s"):
        value = getattr(cfg, key)
        if not (value >= 0 and value < float("inf")):
            raise DdpJobError(
                f"config key 'watchdog.{key}' = {value} is invalid: must be >= 0 and finite",
                f"fix it in the YAML or with watchdog.{key}=...",
            )
    if cfg.stall_s and cfg.stall_s >= collective_timeout_s:
        raise DdpJobError(
            f"config key 'watchdog.stall_s' = {cfg.stall_s:g} is invalid: must be below dist.timeout_s "
            f"({collective_timeout_s:g}), or a hung collective times out and fails the job before the watchdog "
            "can requeue it",
            "lower watchdog.stall_s or raise dist.timeout_s; watchdog.stall_s=0 turns the watchdog off",
        )
    if cfg.stall_s and cfg.first_step_s < cfg.stall_s:
        raise DdpJobError(
            f"config key 'watchdog.first_step_s' = {cfg.first_step_s:g} is invalid: must be >= watchdog.stall_s "
            f"({cfg.stall_s:g})",
            "the first step (imports, rendezvous, datasets) takes longer than a step: raise watchdog.first_step_s",
        )


@dataclass
class TrialConfig:
    """The config's ``trial`` section: written by an adaptive sweep's worker (docs/sweeps.md), not by hand."""

    storage: Optional[str] = None  # the study's journal file (SWEEP/study.journal); null: not a trial of a search
    number: int = -1  # the Optuna trial number this run is bound to
    metric: str = "loss"  # the eval metric reported at each eval (eval/<metric>)

    @property
    def bound(self) -> bool:
        return self.storage is not None


def validate_trial(trial: TrialConfig) -> None:
    if trial.storage is not None and trial.number < 0:
        raise DdpJobError(
            f"config key 'trial.number' = {trial.number} is invalid with trial.storage set",
            "trial: is written by an adaptive sweep's worker; remove the section for an ordinary run",
        )
    if not trial.metric:
        raise DdpJobError("config key 'trial.metric' is empty", "name an eval metric, e.g. loss")


def swept_arg_name(key: str) -> Optional[str]:
    """``NAME`` of a sweep key ``script.args.NAME``; None for every other key (config keys)."""
    return key[len(SWEPT_ARG_PREFIX) :] if key.startswith(SWEPT_ARG_PREFIX) else None


def arg_value(text: str) -> str:
    """A swept value as the script receives it: the text as the sweep lists it (``1e-4`` stays ``1e-4``, ``true``
    and ``null`` stay words), except that a value in quotes loses them (``'a,b'``: quotes keep a comma from splitting
    the values; a sweep file's strings reach the sweep quoted this way)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        import yaml  # the sweep's quoting is YAML's: 'it''s' and "a\tb" unquote as they would in a config value

        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            return text
        if isinstance(value, str):
            return value
    return text


def with_swept_args(script: ScriptConfig, swept: Mapping[str, str]) -> list[str]:
    """A sweep trial's arguments: ``script.args`` as they are, then one argument per swept ``script.args.NAME`` in
    ``swept``'s order (NAME -> the value's text as the sweep lists it): ``--NAME=VALUE``, or ``NAME=VALUE`` with
    ``script.arg_style: hydra``. Refused, naming the key: no script, a NAME that is not an option name (a Hydra key
    with hydra), a NAME the fixed arguments already give (the script would see it twice)."""
    for name in swept:
        key = f"{SWEPT_ARG_PREFIX}{name}"
        if not script.enabled:
            raise DdpJobError(
                f"sweep key '{key}' is a script argument, but the sweep runs no script (script.path or script.module)",
                "ddpjob sweep --script train.py [CONFIG] script.args.NAME=v1,v2 -- FIXED_ARGS",
            )
        hydra = script.arg_style == "hydra"
        if not (_HYDRA_NAME if hydra else _FLAG_NAME).fullmatch(name):
            what, example = ("a Hydra key", "script.args.optim.lr") if hydra else ("an option name", "script.args.lr")
            raise DdpJobError(
                f"sweep key '{key}': {name!r} is not {what}",
                f"e.g. {example}=1e-4,3e-4 (letters, digits, '_', '-'" + (", '.' between parts)" if hydra else ")"),
            )
        clash = next((arg for arg in script.args if _names(arg, name, hydra)), None)
        if clash is not None:
            raise DdpJobError(
                f"sweep key '{key}' is also in the script's fixed arguments ({clash!r}): the script would get it twice",
                f"drop {clash!r} from script.args (the arguments after --), or stop sweeping {key}",
            )
    style = ARG_STYLES[script.arg_style]
    return [*script.args, *(style.format(name=name, value=arg_value(text)) for name, text in swept.items())]


def _names(arg: str, name: str, hydra: bool) -> bool:
    """Whether a fixed argument sets ``name``: ``--name`` / ``--name=v``, or Hydra's ``name=v`` / ``+name=v`` /
    ``++name=v`` / ``~name``."""
    if hydra:
        return arg.lstrip("+~").partition("=")[0] == name
    return arg == f"--{name}" or arg.startswith(f"--{name}=")
