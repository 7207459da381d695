"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded over all ranks.

Each rank keeps 1/world of every parameter (a DTensor sharded on dim 0 over a 1-D mesh of all ranks); a
block's full parameters are all-gathered just for its forward and backward, and gradients are
reduce-scattered. Every rank is a data-parallel replica (its own batch). ``fully_shard`` goes on each unit
(``ddp_core.strategies.units.shard_units``: the modules of ``strategy.wrap_classes``, else of the model's
``_no_split_modules``, else its top-level children), so one block is gathered at a time, then on the root,
which takes the remaining parameters (tied ones among them). Checkpoints are sharded
(``ddp_core.checkpoint.sharded``): no rank ever holds the whole state for them. On a single process without a
process group (``python -m ddp_core`` alone), a one-rank group is created, so the same code (and mixed precision)
runs.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ddp_core.distributed import groups
from ddp_core.errors import DdpJobError
from ddp_core.strategies.base import Strategy
from ddp_core.strategies.units import candidate_units, checkpoint_activations, shard_units, wrap_class_names

log = logging.getLogger(__name__)

# Gathered on every rank: the same full weights wherever they are read (cpu_offload=True would give rank 0 only).
_FULL = StateDictOptions(full_state_dict=True)


class FSDPStrategy(Strategy):
    checkpoint_kind = "sharded"
    steps_communicate = True

    def wrap(self, model: nn.Module) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            raise DdpJobError(
                f"strategy.name='fsdp' has nothing to shard: {type(model).__name__} has no trainable parameters",
                "check the task's build_model, or use strategy.name=ddp",
            )
        groups.ensure_single_process_group(self.device)  # a process started alone has no group
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.cfg.reshard_after_forward}
        if self.cfg.mixed_precision == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = model.to(self.device)
        _, source = wrap_class_names(model, self.cfg.wrap_classes)  # before fully_shard renames the classes
        units = shard_units(model, self.cfg.wrap_classes)
        if self.cfg.activation_checkpointing:
            checkpoint_activations(candidate_units(model, self.cfg.wrap_classes))
        if not units:
            self._single_unit(model)
        for unit in units:
            fully_shard(unit, **options)
        fully_shard(model, **options)
        mixed, reshard = self.cfg.mixed_precision or "off", self.cfg.reshard_after_forward
        log.info(
            "fsdp: %d blocks + root sharded over %d ranks (units from %s), mixed precision %s, reshard after "
            "forward %s",
            len(units),
            mesh.size(),
            source,
            mixed,
            reshard,
        )
        return model

    def _single_unit(self, model: nn.Module) -> None:
        """A model of several parameterised modules sharded as one unit gathers all its weights at once: FSDP's
        memory saving is gone. strategy.single_unit says whether that is an error."""
        holders = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
        if holders < 2:
            return  # one layer: nothing to split
        message = (
            f"fsdp: {type(model).__name__} ({holders} modules with parameters) is sharded as one unit: every rank "
            "gathers all of its weights at once"
        )
        hint = "name its block class in strategy.wrap_classes (e.g. [GPT2Block]); strategy.single_unit=warn allows it"
        if self.cfg.single_unit == "fail":
            raise DdpJobError(message, hint)
        log.warning("%s; %s", message, hint)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard changes the module in place; its state_dict keys stay the plain model's

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return _no_gradient_sync(model) if isinstance(model, FSDPModule) else contextlib.nullcontext()

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.full_model_state(model)

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=_FULL))  # full: plain tensors

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        # A full checkpoint (e.g. written under ddp): each rank keeps its slice of the full tensors.
        set_model_state_dict(model, dict(state), options=_FULL)  # a copy: it replaces the values with DTensors

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(model, optimizer, by_parameter_name(model, optimizer, state), options=_FULL)


@contextlib.contextmanager
def _no_gradient_sync(model: FSDPModule) -> Iterator[None]:
    # FSDP2 keeps unsharded gradients across these micro-steps and reduce-scatters once, on the last one.
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def by_parameter_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` of a replicated model (parameters numbered in optimizer order) keyed by
    parameter names instead, the form ``set_optimizer_state_dict`` takes."""
    names = {id(p): name for name, p in model.named_parameters()}
    number_to_name: dict[Any, str] = {}
    param_groups = []
    for saved, current in zip(state["param_groups"], optimizer.param_groups, strict=True):
        for number, param in zip(saved["params"], current["params"], strict=True):
            number_to_name[number] = names[id(param)]
        param_groups.append(saved | {"params": [number_to_name[n] for n in saved["params"]]})
    return {"state": {number_to_name[n]: s for n, s in state["state"].items()}, "param_groups": param_groups}
