"""A pipeline file (``ddpjob pipeline FILE``): named steps, each a config or a script with overrides, and ``after:``
between them. Read and checked here, torch-free, before any step's config is loaded: its keys, each step's shape,
``after`` names and conditions, and cycles, each refused in one line naming the step. ``Pipeline.steps`` is the
order the steps are submitted in (every step after the steps it waits for, else the file's order).

.. code-block:: yaml

    name: digits            # optional: the file's stem; the record goes to ROOT/pipelines/NAME/pipeline.json
    root: runs              # optional: the runs root of that record (each step's runs go to its own run.root)
    steps:                  # config and script paths: from this file's folder
      train:
        config: ../digits.yaml
        overrides: [train.max_steps=200, checkpoint.monitor=max:eval/accuracy]
      export:
        script: ../../examples/pipeline/export_best.py
        args: [--checkpoint, "${steps.train.best_checkpoint}"]
        after: train        # NAME[:ok|any|notok], or a list of them
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from ddp_core.checkpoint.step_refs import AT_SUBMIT, FIELDS
from ddp_core.config.input import read_yaml_mapping
from ddp_core.errors import DdpJobError
from jobs.pipelines.after import After

KEYS = ("name", "root", "steps")
STEP_KEYS = ("config", "script", "args", "overrides", "after")
NAME = re.compile(r"[A-Za-z0-9_-]+")  # what ${steps.NAME.FIELD} can name (ddp_core.checkpoint.step_refs)
HINT = "see docs/pipelines.md and configs/pipelines/digits.yaml"


@dataclass(frozen=True)
class Step:
    name: str
    config: Optional[str] = None  # a YAML config, as `ddpjob submit CONFIG` takes it
    script: Optional[str] = None  # script mode: the script, as `--script` takes it
    args: Optional[tuple[str, ...]] = None  # the script's arguments (after `--`), taken as they are
    overrides: tuple[str, ...] = ()  # key=value, as on the command line
    after: tuple[After, ...] = ()  # the steps it waits for, each with its condition


@dataclass(frozen=True)
class Pipeline:
    name: str
    file: Path
    root: Path
    steps: tuple[Step, ...]  # in submission order

    @property
    def folder(self) -> Path:
        """Where the pipeline's record lives (``jobs.pipelines.record``)."""
        return self.root / "pipelines" / self.name

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)

    def upstream(self, name: str) -> set[str]:
        """Every step ``name`` waits for, directly or through others."""
        seen: set[str] = set()
        todo = [a.ref for a in self.step(name).after]
        while todo:
            if (ref := todo.pop()) not in seen:
                seen.add(ref)
                todo.extend(a.ref for a in self.step(ref).after)
        return seen


def _refuse(where: str, what: str, hint: str = HINT) -> DdpJobError:
    return DdpJobError(f"{where}: {what}", hint)


def _strings(value: Any, where: str, key: str) -> tuple[str, ...]:
    """A list of strings (one string is a list of one for ``after``)."""
    if isinstance(value, str) and key == "after":
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise _refuse(where, f"'{key}' must be a list of strings, not {value!r}")
    return tuple(str(v) for v in value)


def parse_step(name: str, body: Any, where: str) -> Step:
    if not NAME.fullmatch(name):
        raise _refuse(where, "a step's name is letters, digits, '_' and '-'", "rename the step")
    if not isinstance(body, dict):
        raise _refuse(where, f"a step is a mapping of {', '.join(STEP_KEYS)}, not {body!r}")
    if unknown := sorted(set(body) - set(STEP_KEYS)):
        raise _refuse(where, f"unknown key '{unknown[0]}'", f"a step's keys are {', '.join(STEP_KEYS)}")
    config, script = body.get("config"), body.get("script")
    if config is None and script is None:
        raise _refuse(where, "a step needs a config or a script", "add config: FILE.yaml or script: TRAIN.py")
    for key, value in (("config", config), ("script", script)):
        if value is not None and not isinstance(value, str):
            raise _refuse(where, f"'{key}' must be a path, not {value!r}")
    if "args" in body and script is None:
        raise _refuse(where, "'args' are a script's arguments: this step has no script", "add script: TRAIN.py")
    args = _strings(body["args"], where, "args") if "args" in body else None
    overrides = _strings(body.get("overrides", []), where, "overrides")
    after = tuple(After.parse(text, f"{where}: after") for text in _strings(body.get("after", []), where, "after"))
    return Step(name, config, script, args, overrides, after)


def order(steps: dict[str, Step], where: str) -> tuple[Step, ...]:
    """Every step after the steps it waits for (the file's order otherwise); unknown names and cycles refused."""
    for step in steps.values():
        for a in step.after:
            if a.ref not in steps:
                known = ", ".join(steps)
                raise _refuse(f"{where}: step '{step.name}'", f"after '{a.ref}': no such step", f"steps: {known}")
            if a.ref == step.name:
                raise _refuse(f"{where}: step '{step.name}'", "a step cannot run after itself")
    done: list[str] = []
    state: dict[str, str] = {}  # name -> "visiting" | "done"

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise _refuse(where, f"steps {cycle} form a cycle", "remove one of these after: entries")
        state[name] = "visiting"
        for a in steps[name].after:
            visit(a.ref, [*path, name])
        state[name] = "done"
        done.append(name)

    for name in steps:
        visit(name, [])
    return tuple(steps[name] for name in done)


def load(path: Path) -> Pipeline:
    """The pipeline file at ``path``, checked (see the module docstring); ``DdpJobError`` in one line otherwise."""
    where = f"pipeline {path}"
    data = read_yaml_mapping(path)
    if unknown := sorted(set(data) - set(KEYS)):
        raise _refuse(where, f"unknown key '{unknown[0]}'", f"a pipeline's keys are {', '.join(KEYS)}")
    body = data.get("steps")
    if not isinstance(body, dict) or not body:
        raise _refuse(where, "'steps' must map each step's name to its config or script")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _refuse(where, f"'name' = {name!r}: letters, digits, '_' and '-'", "rename the pipeline")
    root = data.get("root", "runs")
    if not isinstance(root, str) or not root:
        raise _refuse(where, f"'root' = {root!r} must be a folder", "e.g. root: runs")
    steps = {str(k): from_folder(parse_step(str(k), v, f"{where}: step '{k}'"), path.parent) for k, v in body.items()}
    return Pipeline(name, path, Path(root), order(steps, where))


def from_folder(step: Step, folder: Path) -> Step:
    """A step's ``config`` and ``script`` paths taken from the pipeline file's folder, as a sweep file's ``base:``
    is (``jobs.sweeps.spec``): the file means the same from wherever it is run."""

    def located(value: Optional[str]) -> Optional[str]:
        if value is None or Path(value).expanduser().is_absolute():
            return value and str(Path(value).expanduser())
        return os.path.normpath(folder / value)

    return replace(step, config=located(step.config), script=located(step.script))


def check_references(pipe: Pipeline, step: Step, refs: list[tuple[str, str, str]]) -> None:
    """Each ``${steps.NAME.FIELD}`` of a step's loaded config (``(key, NAME, FIELD)``) names a step it waits for and
    a known field, under a key read when the step starts."""
    where = f"pipeline {pipe.file}: step '{step.name}'"
    names = [s.name for s in pipe.steps]
    for key, ref, field in refs:
        text = f"${{steps.{ref}.{field}}}"
        if key.startswith(AT_SUBMIT):
            raise _refuse(
                where,
                f"config key '{key}' = {text}: it is used when the step is submitted, before '{ref}' has run",
                "use references in the task's, trainer's or script's keys and arguments, read as the step starts",
            )
        if ref not in names:
            raise _refuse(where, f"{text}: no step '{ref}'", f"steps: {', '.join(names)}")
        if field not in FIELDS:
            raise _refuse(where, f"{text}: unknown field '{field}'", f"a step's fields: {', '.join(FIELDS)}")
        if ref not in pipe.upstream(step.name):
            raise _refuse(
                where, f"{text}: '{ref}' is not a step this one runs after", f"add after: {ref} to step '{step.name}'"
            )
