"""The interface a user implements to train their own model, and the loader that finds it by import path.

A task is a class named in the config as ``task.target = "package.module:ClassName"``. It is built as
``ClassName(**task.data)`` on every rank and provides ``build_model``, ``build_datasets`` and ``score``
(loss and metric sums from the model's output) — or overrides ``compute`` for a forward that does not
fit ``model(inputs)``. See docs/models.md, "Plugging in your own model".
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ddp_core.config import OptimConfig, TaskConfig
from ddp_core.errors import DdpJobError


@dataclass
class Output:
    """What ``Task.compute`` returns for one batch.

    ``loss`` is the mean loss to backpropagate. ``sums`` are per-batch *sums* of metrics (e.g. summed
    loss, number correct); the trainer adds them over batches and ranks and divides by the summed
    ``count``, so evaluation is exact whatever the batch and world size. A training step's sums
    (``torch.is_grad_enabled()``; it may leave them out) are logged the same way as ``train/<name>``, averaged
    over the steps since the last progress line.
    """

    loss: torch.Tensor
    count: int
    sums: dict[str, torch.Tensor] = field(default_factory=dict)


class Task(ABC):
    @classmethod
    def check_args(cls, data: dict[str, Any], model: dict[str, Any]) -> None:
        """Login-node check of the task's arguments before anything is submitted; raise ``DdpJobError`` naming
        the key (``task.data.X`` / ``task.model.X``) for a value the job could not use.

        ``data`` holds ``__init__``'s keyword arguments and ``model`` ``build_model``'s, each with the signature's
        defaults filled in, already checked against their annotations (names and types). Called by ``ddpjob
        submit`` and ``ddpjob sweep`` for every trial: keep it cheap (no data loading, no model building).
        The default accepts everything."""
        return None

    @abstractmethod
    def build_model(self, *args: Any, **model_args: Any) -> nn.Module:
        """The model, on the CPU; called after the trainer seeds torch so every rank builds the same one. It gets
        ``task.model``'s keys as keyword arguments: name them in your override (``*args`` is here only so that type
        checkers accept an override with its own parameters; nothing is passed positionally)."""

    @abstractmethod
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, eval) datasets. No downloads on compute nodes: read local files or package data. The train set
        may be an ``IterableDataset`` (a token stream): rank r then trains on every world-th sample of it, and a
        resumed run continues mid-epoch (the loader's position is in the checkpoint; the stream must yield the same
        samples in the same order each time it is iterated, or implement ``state_dict``/``load_state_dict``)."""

    def collate_fn(self, samples: list[Any]) -> Any:
        """One batch from a list of samples (padding, packing, dicts of tensors); runs in the loader's workers.
        The default stacks them (``torch.utils.data.default_collate``)."""
        return default_collate(samples)

    def configure_optimizer(self, model: nn.Module, cfg: OptimConfig) -> Optional[torch.optim.Optimizer]:
        """An optimizer over ``model``'s parameters (the wrapped model: build it from ``model.parameters()`` or
        ``named_parameters()``), or None for the one ``optim.*`` configures (the default)."""
        return None

    def configure_scheduler(
        self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int
    ) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
        """A scheduler stepped once per optimizer step (its ``state_dict`` is checkpointed), or None for warmup and
        ``optim.schedule`` (the default)."""
        return None

    def pipeline_blocks(self, model: nn.Module) -> Optional[list[nn.Module]]:
        """The model's blocks in forward order, for strategy.name=pipeline and model_parallel, which cut the list
        into consecutive stages: applying them one after the other to ``split(batch)``'s inputs must give what
        ``score`` takes. Blocks may be small adapter modules around the model's own submodules (an embedding
        block, one per transformer layer, a head), as long as together they hold every parameter. A parameter
        held by blocks of two stages (tied embeddings) is kept on both and its gradients are summed between
        them. Also called on the login node with the model on the ``meta`` device. None (the default): an
        ``nn.Sequential``'s children."""
        return None

    def flops_per_sample(self, model: nn.Module) -> Optional[float]:
        """Training FLOPs (forward and backward) of one sample through ``model`` (the unwrapped model, on the CPU,
        called once before training), for the MFU in each progress line; None (the default): no MFU is shown.
        ``ddp_core.tasks.flops`` has the usual estimates (``transformer_flops_per_sample``: 6N + attention)."""
        return None

    def tokens_per_sample(self) -> Optional[int]:
        """Tokens in one sample (a sequence's length), for tokens/s in each progress line; None (the default): a
        task without tokens."""
        return None

    def split(self, batch: Any) -> tuple[Any, Any]:
        """(model inputs, targets) of a batch. The pipeline strategy feeds inputs to its first stage and
        targets to its last, so this is the only place a batch's layout is known."""
        inputs, targets = batch
        return inputs, targets

    def score(self, output: Any, targets: Any) -> Output:
        """Loss and metric sums from the model's output. Needed by strategies where no process holds the
        whole model (pipeline); the default ``compute`` uses it too."""
        raise NotImplementedError(f"{type(self).__name__} must implement score() (or compute())")

    def compute(self, model: nn.Module, batch: Any) -> Output:
        """Forward one batch (already on the model's device) and return loss and metric sums."""
        inputs, targets = self.split(batch)
        return self.score(model(inputs), targets)


_MAIN_GUARD_HINT = 'move the script part under `if __name__ == "__main__":` (ddpjob imports the module for its Task)'
_EXITS = {("sys", "exit"), ("", "exit"), ("", "quit")}


def _module_level_side_effect(module_name: str) -> Optional[str]:
    """Where the module's top-level code (outside functions, classes and ``if __name__ == "__main__"``) parses the
    command line or exits: "file:line what", or None. Importing it would take over ddpjob's own argv (a training
    script's ``argparse`` at module level) on the login node. Read from the source, before the import runs it."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None  # the import itself reports it
    origin = spec.origin if spec is not None else None
    if origin is None or not origin.endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(origin).read_text(), origin)
    except (OSError, SyntaxError, ValueError):
        return None  # the import reports a syntax error with its own message

    def scan(node: ast.AST) -> Optional[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return None
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            return None
        found = None
        if isinstance(node, ast.Attribute) and node.attr == "argv" and ast.unparse(node.value) == "sys":
            found = "reads sys.argv"
        elif isinstance(node, ast.Call):
            func = node.func
            name = (ast.unparse(func.value), func.attr) if isinstance(func, ast.Attribute) else ("", ast.unparse(func))
            if name[1] in ("parse_args", "parse_known_args") or name in _EXITS:
                found = f"calls {ast.unparse(func)}()"
        if found is not None:
            return f"{origin}:{getattr(node, 'lineno', '?')} {found}"
        return next((hit for child in ast.iter_child_nodes(node) if (hit := scan(child))), None)

    return next((hit for stmt in tree.body if (hit := scan(stmt))), None)


def _resolve(target: str) -> type[Task]:
    module_name, _, attr = target.partition(":")
    if module_name not in sys.modules:
        side_effect = _module_level_side_effect(module_name)
        if side_effect is not None:
            raise DdpJobError(f"task.target '{target}': module-level code {side_effect}", _MAIN_GUARD_HINT)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise DdpJobError(
            f"task.target '{target}': cannot import module '{module_name}' ({err})",
            "check the module path and that it is importable on the compute nodes (installed or on PYTHONPATH)",
        ) from None
    except SystemExit as err:  # what the source check cannot see (an exit inside a function called at import)
        raise DdpJobError(
            f"task.target '{target}': importing '{module_name}' exited (code {err.code})", _MAIN_GUARD_HINT
        ) from None
    obj = getattr(module, attr, None)
    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise DdpJobError(
            f"task.target '{target}': '{attr}' is not a ddp_core.tasks.base.Task subclass in {module_name}",
            "name a class that subclasses ddp_core.tasks.base.Task",
        )
    if inspect.isabstract(obj):  # it would fail only on the compute node, at Task(...)
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise DdpJobError(
            f"task.target '{target}' is abstract: it does not implement {missing}",
            "name your Task subclass, which implements build_model and build_datasets",
        )
    return obj


def _signature_chain(cls: type, method: str) -> list[Any]:
    """``cls``'s ``method`` and, while each takes ``**kwargs`` (passed on to ``super()``), its bases' versions."""
    chain = []
    for owner in cls.__mro__:
        fn = owner.__dict__.get(method)
        if fn is None or owner in (Task, object):
            continue
        fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
        chain.append(fn)
        if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
            break
    return chain


def _check_kwargs(cls: type, method: str, given: dict[str, Any], key: str) -> dict[str, Any]:
    """Refuse unknown and missing keyword arguments of ``cls.method``, and values that do not fit the annotations
    of the method that names them (following ``**kwargs`` into the bases); returns the arguments with the
    signatures' defaults filled in."""
    chain = _signature_chain(cls, method)
    if not chain:
        return dict(given)
    owner: dict[str, Any] = {}  # parameter name -> the first method of the chain that names it
    defaults: dict[str, Any] = {}
    for fn in chain:
        for name, p in inspect.signature(fn).parameters.items():
            if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in owner:
                owner[name] = fn
                if p.default is not p.empty:
                    defaults[name] = p.default
    for name, value in given.items():
        fn = owner.get(name)
        hint = _hints(fn).get(name, Any) if fn is not None else Any
        if fn is not None and not _fits(value, hint):  # without fn the hint is Any: anything fits
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise DdpJobError(
                f"config key '{key}.{name}' = {shown} is invalid: {fn.__qualname__} expects {_type_name(hint)}",
                f"fix it in the YAML or with {key}.{name}=...",
            )
    params = inspect.signature(chain[0]).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        unknown = sorted(set(given) - accepted)
        if unknown:
            raise DdpJobError(
                f"unknown config key '{key}.{unknown[0]}' for {chain[0].__qualname__}",
                f"accepted keys: {', '.join(sorted(accepted)) or 'none'}",
            )
        missing = [n for n, p in params.items() if n in accepted and p.default is p.empty and n not in given]
        if missing:
            raise DdpJobError(
                f"config key '{key}.{missing[0]}' is required by {chain[0].__qualname__}",
                f"set {key}.{missing[0]}=...",
            )
    return {**defaults, **given}


def _hints(fn: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # an annotation that does not evaluate here (a name only the type checker imports): unchecked
        return {}


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _fits(value: Any, hint: Any) -> bool:
    """Whether a config value (YAML scalars, lists, mappings) fits an annotation. Checked: None, bool, int, float
    (an int fits), str, Any, Optional/Union, Literal, list/tuple/Sequence, dict/Mapping and their item types.
    Anything else (a class of the user's, a Path, a TypeVar) accepts any value: the config cannot make one."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any or isinstance(hint, (str, typing.TypeVar)):  # unevaluated forward reference: unchecked
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    container = origin or hint
    if container in (list, tuple, Sequence, typing.Sequence) or container is set:
        if not isinstance(value, list):
            return False
        if container is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(_fits(v, args[0]) for v in value)
    if container in (dict, Mapping, typing.Mapping):
        return isinstance(value, dict) and (
            not args or all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
        )
    return True


def check_task(cfg: TaskConfig) -> None:
    """Login-node check: the task imports, accepts exactly the configured model/data keys with values of the
    annotated types, and its ``check_args`` accepts them."""
    cls = _resolve(cfg.target)
    data = _check_kwargs(cls, "__init__", cfg.data, "task.data")
    model = _check_kwargs(cls, "build_model", cfg.model, "task.model")
    cls.check_args(data, model)


def load_task(cfg: TaskConfig) -> Task:
    check_task(cfg)
    return _resolve(cfg.target)(**cfg.data)
