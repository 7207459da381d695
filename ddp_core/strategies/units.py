"""How a model is cut up: FSDP's shard units (``strategy.wrap_classes``) and the ordered blocks that pipeline and
model_parallel split into stages (``Task.pipeline_blocks``), with the parameters tied between them.

Used on the compute node by the strategies and on the login node by ``ddp_core.strategies.check`` on a model built on
the ``meta`` device, so the same rules decide both: a mistake found at submit time is the one the job would hit.
Only torch is needed here (no distributed imports): the login-node check stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from torch import nn

from ddp_core.errors import DdpJobError

if TYPE_CHECKING:
    from ddp_core.tasks.base import Task


def class_names(model: nn.Module) -> list[str]:
    """The distinct class names of ``model``'s submodules (itself included), in first-seen order."""
    return list(dict.fromkeys(type(m).__name__ for m in model.modules()))


def wrap_class_names(model: nn.Module, configured: Optional[Sequence[str]]) -> tuple[list[str], str]:
    """(class names whose modules become units, where they came from): ``strategy.wrap_classes`` when set, else
    the model's ``_no_split_modules`` (Hugging Face models declare their block class there), else none."""
    if configured is not None:
        present = set(class_names(model))
        for name in configured:
            if name not in present:
                shown = ", ".join(n for n in class_names(model) if n != type(model).__name__)
                raise DdpJobError(
                    f"config key 'strategy.wrap_classes' names {name!r}, but {type(model).__name__} has no module "
                    f"of that class (it has: {shown[:300]})",
                    "name the class of the model's repeated block (e.g. GPT2Block), or leave wrap_classes null",
                )
        return list(configured), "strategy.wrap_classes"
    declared = getattr(model, "_no_split_modules", None)
    if declared:
        return sorted(declared), "the model's _no_split_modules"
    return [], "top-level children"


def shard_units(model: nn.Module, wrap_classes: Optional[Sequence[str]] = None) -> list[nn.Module]:
    """The modules that get their own ``fully_shard`` before the root, outermost first.

    The modules of the wrap classes (see ``wrap_class_names``; the outermost match, never the root itself), else
    the top-level children with parameters. A unit that shares a parameter with another unit or with a module
    outside it is left to the root: a tied weight must live in one unit (e.g. GPT-2's ``wte``/``lm_head``)."""
    units = candidate_units(model, wrap_classes)
    shared = shared_parameters(units)
    return [unit for i, unit in enumerate(units) if i not in shared and not _used_outside(unit, model)]


def _used_outside(unit: nn.Module, model: nn.Module) -> bool:
    """Whether a module outside ``unit`` holds one of its parameters (GPT-2's lm_head holds the embedding's weight)."""
    inside, own = {id(m) for m in unit.modules()}, {id(p) for p in unit.parameters()}
    return any(id(p) in own for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False))


def candidate_units(model: nn.Module, wrap_classes: Optional[Sequence[str]] = None) -> list[nn.Module]:
    """``shard_units`` before tied units are dropped: also the modules activation checkpointing recomputes."""
    names, _ = wrap_class_names(model, wrap_classes)
    if names:
        wanted = set(names)
        units: list[nn.Module] = []
        inside: set[int] = set()  # modules already inside a chosen unit
        for module in model.modules():
            if module is model or id(module) in inside:
                continue
            if type(module).__name__ in wanted and any(True for _ in module.parameters()):
                units.append(module)
                inside.update(id(m) for m in module.modules())
    else:
        # An nn.Sequential may hold one module twice (a tied layer): both places count, so the tie is seen.
        children = list(model) if isinstance(model, nn.Sequential) else list(model.children())
        units = [child for child in children if any(True for _ in child.parameters())]
    return units


def checkpoint_activations(units: Sequence[nn.Module]) -> None:
    """Recompute each unit's activations in backward (``torch.utils.checkpoint``, non-reentrant) instead of keeping
    them. The unit's own ``forward`` is wrapped in place, not the module: parameter names, and so checkpoints, stay
    the plain model's, and FSDP's hooks (on the module call) still gather the unit's weights around it."""
    from torch.utils.checkpoint import checkpoint

    for unit in units:
        forward = unit.forward

        def recomputed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        unit.forward = recomputed


def shared_parameters(groups: Sequence[nn.Module]) -> dict[int, set[int]]:
    """For each group index that shares a parameter with another group: the other groups' indices."""
    owners: dict[int, set[int]] = {}
    for i, group in enumerate(groups):
        for p in group.parameters():
            owners.setdefault(id(p), set()).add(i)
    shared: dict[int, set[int]] = {}
    for holders in owners.values():
        if len(holders) > 1:
            for i in holders:
                shared.setdefault(i, set()).update(holders - {i})
    return shared


def model_blocks(model: nn.Module, task: Optional[Task], strategy: str) -> list[nn.Module]:
    """The model's blocks in forward order, for pipeline and model_parallel: ``task.pipeline_blocks(model)``
    when the task defines it, else an ``nn.Sequential``'s children, else the model's ``stages`` ModuleList.
    Applying the blocks in order to the task's inputs must give what ``Task.score`` takes."""
    blocks = task.pipeline_blocks(model) if task is not None else None
    if blocks is not None:
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
            raise DdpJobError(
                f"{type(task).__name__}.pipeline_blocks returned {len(blocks)} items, not a non-empty list of "
                "nn.Module blocks",
                "return the model's blocks in forward order (see docs/models.md, 'Bringing a Hugging Face model')",
            )
        in_blocks, in_model = {id(p) for b in blocks for p in b.parameters()}, {id(p) for p in model.parameters()}
        if in_blocks - in_model:
            raise DdpJobError(
                f"{type(task).__name__}.pipeline_blocks returned blocks with parameters the model does not have",
                "blocks may only wrap the model's own submodules (no new weights in the adapters)",
            )
        missing = in_model - in_blocks
        if missing:
            names = [n for n, p in model.named_parameters() if id(p) in missing]
            raise DdpJobError(
                f"{type(task).__name__}.pipeline_blocks leaves {len(names)} parameters in no block (e.g. {names[0]!r})",
                "every weight the forward uses must be in one of the blocks",
            )
        return blocks
    if isinstance(model, nn.Sequential) and len(model) > 0:
        return list(model)
    stages = getattr(model, "stages", None)
    # A model with `stages` promises that applying them in order is its forward and that they hold every weight.
    if isinstance(stages, (nn.Sequential, nn.ModuleList)):
        inside = {id(p) for stage in stages for p in stage.parameters()}
        if inside == {id(p) for p in model.parameters()}:
            return list(stages)
    raise DdpJobError(
        f"strategy.name={strategy!r} needs an nn.Sequential model or a task whose pipeline_blocks(model) lists its "
        f"blocks; {type(model).__name__} from {type(task).__name__ if task is not None else 'this task'} is neither",
        "define Task.pipeline_blocks to return the model's blocks in forward order, or use strategy.name=ddp or fsdp",
    )


def stage_ranges(counts: Sequence[int]) -> list[range]:
    """Block index ranges of consecutive stages holding ``counts`` blocks each."""
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def ties_across_stages(blocks: Sequence[nn.Module], counts: Sequence[int], model: nn.Module) -> dict[str, list[int]]:
    """Parameters held by blocks of more than one stage: {a parameter name: the stages that hold it}."""
    stage_of = {i: s for s, r in enumerate(stage_ranges(counts)) for i in r}
    holders: dict[int, set[int]] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            holders.setdefault(id(p), set()).add(stage_of[i])
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter is named once, by its first path
    return {names.get(pid, "?"): sorted(s) for pid, s in holders.items() if len(s) > 1}
