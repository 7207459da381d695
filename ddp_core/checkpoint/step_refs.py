"""A pipeline step's references to an earlier step's outputs, ``${steps.NAME.FIELD}`` in any string of its config
(``ddpjob pipeline``, ``jobs.pipelines``), resolved when the step starts, on the compute node, not when it is
submitted: the earlier step may still be training then.

The login node leaves each reference in the step's config.yaml as it is written (``to_yaml`` keeps a ``${`` literal)
and records where the earlier steps' run directories are in the step's own run directory (``RECORD``,
``write_record``). Every rank of every attempt resolves the references as it starts (``resolve``): ``run_dir`` is
that directory, ``best_checkpoint`` the checkpoint its ``checkpoint.monitor`` marked best (as ``ddpjob export
--best`` finds it, verified), ``latest_checkpoint`` its newest verified one. A step that cannot resolve one (no best
checkpoint marked) fails in one line, as a user error. ``walk`` is the one traversal of a config's strings, which the
login node's validation uses too. Torch is imported only to read a checkpoint reference.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from ddp_core.config import Config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir, atomic_write_text

RECORD = "pipeline_step.json"  # in the step's run directory: the pipeline, the step, the earlier steps' run dirs
FIELDS = ("run_dir", "best_checkpoint", "latest_checkpoint")
# Keys used when the step is submitted (its run directory, the batch script, the code snapshot, where checkpoints
# go), before the earlier step ran: a reference there could never be resolved in time.
AT_SUBMIT = ("run.", "slurm.", "snapshot.", "script.path", "script.module", "checkpoint.dir")
REFERENCE = re.compile(r"\$\{steps\.([A-Za-z0-9_-]+)\.([A-Za-z0-9_]+)\}")


def walk(value: Any, edit: Callable[[str], str]) -> Any:
    """``value`` with ``edit`` applied to every string in it: a config's dataclasses (edited in place), lists,
    tuples and dicts (values only)."""
    if isinstance(value, str):
        return edit(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            setattr(value, f.name, walk(getattr(value, f.name), edit))
        return value
    if isinstance(value, list):
        return [walk(v, edit) for v in value]
    if isinstance(value, tuple):
        return tuple(walk(v, edit) for v in value)
    if isinstance(value, dict):
        return {k: walk(v, edit) for k, v in value.items()}
    return value


def strings(value: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """Every string in a config (or any part of it), with the dotted key it is under: ``(key, text)``."""
    if isinstance(value, str):
        yield key, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from strings(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings(item, key)
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from strings(item, f"{key}.{name}" if key else str(name))


def references(cfg: Config) -> list[tuple[str, str, str]]:
    """Every ``(key, step, field)`` the config refers to, in order of appearance."""
    return [(key, m[1], m[2]) for key, text in strings(cfg) for m in REFERENCE.finditer(text)]


def write_record(run_dir: Path, pipeline: str, step: str, steps: Mapping[str, str]) -> None:
    """The login node's record, before the step is queued: ``steps`` maps each earlier step to its run directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"pipeline": pipeline, "step": step, "steps": dict(steps)}
    atomic_write_text(run_dir / RECORD, json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_record(run_dir: RunDir) -> Optional[dict[str, Any]]:
    try:
        record = json.loads((run_dir.path / RECORD).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise DdpJobError(f"{run_dir.path / RECORD} is unreadable ({err})", "submit the pipeline again") from None
    return record if isinstance(record, dict) else None


def value_of(step: str, field: str, run_dir: Path) -> str:
    """What ``${steps.STEP.FIELD}`` stands for, now: the earlier step's run directory ``run_dir`` or a checkpoint."""
    if field == "run_dir":
        return str(run_dir)
    from ddp_core.checkpoint import store  # torch: only a step that names a checkpoint pays for it

    where = RunDir(run_dir).recorded_checkpoints()
    info = store.find_best(where) if field == "best_checkpoint" else store.find_latest(where)
    if info is None:
        why = "no best checkpoint marked (checkpoint.monitor)" if field == "best_checkpoint" else "no checkpoint"
        raise DdpJobError(
            f"${{steps.{step}.{field}}}: step '{step}' ({run_dir}) has {why} that verifies",
            f"set checkpoint.monitor in step '{step}' (e.g. max:eval/accuracy), or use ${{steps.{step}.run_dir}}",
        )
    return str(info.path)


def resolve(cfg: Config, run_dir: RunDir) -> Config:
    """``cfg`` (a step's, as loaded from its run directory) with every ``${steps.NAME.FIELD}`` replaced; the config
    itself when it has none. Raises ``DdpJobError`` for a reference the record cannot answer."""
    wanted = references(cfg)
    if not wanted:
        return cfg
    record = read_record(run_dir) or {}
    found = record.get("steps")
    steps: dict[str, Any] = found if isinstance(found, dict) else {}
    values: dict[tuple[str, str], str] = {}
    for _, step, field in wanted:
        if step not in steps or field not in FIELDS:
            raise DdpJobError(
                f"${{steps.{step}.{field}}} in {run_dir.config_file}: no earlier step '{step}' with field '{field}'"
                f" is recorded in {run_dir.path / RECORD}",
                f"a step's references name an earlier step of its pipeline and one of {', '.join(FIELDS)}",
            )
        if (step, field) not in values:
            values[step, field] = value_of(step, field, Path(steps[step]))
    return walk(cfg, lambda text: REFERENCE.sub(lambda m: values[m[1], m[2]], text))
