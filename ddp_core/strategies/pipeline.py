"""Pipeline parallelism (torch.distributed.pipelining): the model's top-level layers cut into stages across
ranks, micro-batches flowing through them under a GPipe or 1F1B schedule, combined with data parallelism.

Ranks form a 2-D mesh (dp x pp): rank = replica * stages + stage. The blocks are an ``nn.Sequential``'s
children or what ``Task.pipeline_blocks(model)`` returns (``ddp_core.strategies.units.model_blocks``). Every rank
builds the whole model (same seed, so the same weights) and drops the weights of other stages' blocks in place:
parameter names stay those of the plain model, so sharded checkpoints, export and the final digest line up
with every other strategy. A parameter tied across stages (GPT-2's ``wte``/``lm_head``) is kept on each stage
that uses it, its gradients summed between them: the copies take identical steps and stay equal. Gradients of
one stage are averaged over its dp replicas after the schedule's backward. Eval runs forward only, stage to
stage, with explicit shapes (eval batches need not divide into micro-batches).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ddp_core.errors import DdpJobError
from ddp_core.strategies.base import Strategy
from ddp_core.strategies.model_parallel import balanced_split
from ddp_core.strategies.units import model_blocks, stage_ranges, ties_across_stages
from ddp_core.tasks.base import Output, Task

log = logging.getLogger(__name__)
_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.float64]


class PipelineStrategy(Strategy):
    checkpoint_kind = "sharded"
    steps_communicate = True

    def wrap(self, model: nn.Module) -> nn.Module:
        blocks = model_blocks(model, self.task, "pipeline")
        stages, world = self.cfg.stages, self.env.world_size
        if len(blocks) < stages:
            raise DdpJobError(
                f"config key 'strategy.stages' = {stages} exceeds the model's {len(blocks)} top-level layers",
                f"use strategy.stages<={len(blocks)}",
            )
        self.mesh = init_device_mesh(self.device.type, (world // stages, stages), mesh_dim_names=("dp", "pp"))
        self.pp_group, self.dp_group = self.mesh["pp"].get_group(), self.mesh["dp"].get_group()
        self.stage_index, self.replica = self.env.rank % stages, self.env.rank // stages
        self.key_order = list(model.state_dict())
        counts = self.cfg.split or balanced_split([sum(p.numel() for p in b.parameters()) for b in blocks], stages)
        if sum(counts) != len(blocks) or len(counts) != stages:
            raise DdpJobError(
                f"config key 'strategy.split' = {counts} must have {stages} entries summing to {len(blocks)} layers",
                "fix strategy.split or leave it null (balanced by parameter count)",
            )
        owned = stage_ranges(counts)[self.stage_index]
        self._tie_groups(blocks, counts, model)
        keep_only(model, [blocks[i] for i in owned])  # the other stages' weights are dropped, names kept
        stage_module = StageModule(model, [blocks[i] for i in owned]).to(self.device)
        self.stage = PipelineStage(stage_module, self.stage_index, stages, self.device, group=self.pp_group)
        log.info(
            "pipeline: stage %d/%d holds layers %d-%d; replica %d/%d; %s schedule, %d micro-batches",
            self.stage_index,
            stages,
            owned.start,
            owned.stop - 1,
            self.replica,
            world // stages,
            self.cfg.schedule,
            self.cfg.microbatches,
        )
        self._schedule: Optional[Any] = None
        self._scored: list[Output] = []  # what loss_fn scored during the current step (train/<name> metrics)
        return stage_module

    def _tie_groups(self, blocks: list[nn.Module], counts: list[int], model: nn.Module) -> None:
        """Parameters held by blocks of several stages (tied embeddings) stay on each of them: a process group per
        tie, within this replica, sums their gradients so every holder takes the same step (as one model would)."""
        params = dict(model.named_parameters())
        self.tied: list[tuple[nn.Parameter, Any]] = []
        self.norm_skip: set[int] = set()  # tied parameters another stage counts in the gradient norm
        for name, holders in sorted(ties_across_stages(blocks, counts, model).items()):
            for replica in range(self.env.world_size // self.cfg.stages):
                ranks = [replica * self.cfg.stages + s for s in holders]
                group = dist.new_group(ranks)  # collective: every rank creates every group, in the same order
                if self.env.rank in ranks:
                    self.tied.append((params[name], group))
                    if self.stage_index != holders[0]:
                        self.norm_skip.add(id(params[name]))
            if self.stage_index in holders:
                log.info("pipeline: %s is tied across stages %s: its gradients are summed between them", name, holders)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, StageModule) else model

    @property
    def micro_multiple(self) -> int:
        return self.cfg.microbatches

    def probed(self) -> None:
        # A stage infers its micro-batches' shapes at its first step, and keeps them: the probe's were larger.
        stage = self.stage
        self.stage = PipelineStage(stage.submod, stage.stage_index, stage.num_stages, self.device, group=self.pp_group)
        self._schedule = None

    @property
    def data_rank(self) -> int:
        return self.env.rank // self.cfg.stages  # every stage of a replica sees the same batch

    @property
    def data_world(self) -> int:
        return self.env.world_size // self.cfg.stages

    @property
    def reports_loss(self) -> bool:  # type: ignore[override]
        return self.stage.is_last

    def _loss_divisor(self, grad_accum: int) -> int:
        """What each micro-batch's loss is divided by, so that a step's gradient is the mean over its batches.
        Without accumulation the schedule averages over its micro-batches itself (``scale_grads``). With it, the
        loss is divided by every micro-batch of the step instead: the schedule divides all the gradients the stage
        holds at each of its steps, the earlier accumulation steps' too, which would shrink those again and again."""
        return 1 if grad_accum == 1 else self.cfg.microbatches * grad_accum

    def _schedule_for(self, task: Task, grad_accum: int) -> Any:
        if self._schedule is None:
            divisor = self._loss_divisor(grad_accum)

            def loss_fn(output: Any, target: Any) -> torch.Tensor:
                out = task.score(output, target)
                self._scored.append(out)
                return out.loss / divisor

            self._schedule = _SCHEDULES[self.cfg.schedule](
                self.stage, self.cfg.microbatches, loss_fn=loss_fn, scale_grads=grad_accum == 1
            )
        return self._schedule

    def forward_backward(self, task: Task, model: nn.Module, batch: Any, grad_accum: int, sync: bool) -> torch.Tensor:
        schedule = self._schedule_for(task, grad_accum)
        with self.work.forward():  # a stage's forward runs inside the schedule, among its sends and receives
            inputs, targets = task.split(batch)
        losses: list[torch.Tensor] = []
        self._scored = []
        if self.stage.is_first and self.stage.is_last:
            schedule.step(inputs, target=targets, losses=losses)
        elif self.stage.is_first:
            schedule.step(inputs)
        elif self.stage.is_last:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        if sync:
            for param, group in self.tied:  # before the replicas' average: every holder then averages the same sums
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=group)
        if sync and self.mesh["dp"].size() > 1:
            for p in model.parameters():  # average this stage's gradients over its data-parallel replicas
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=self.dp_group)
        # The micro-batches' outputs are the last ones scored: the schedule's first step also calls loss_fn to infer
        # shapes, on the whole batch and uninitialised outputs.
        for out in self._scored[len(self._scored) - len(losses) :]:
            self.on_train_output(out)
        if not losses:  # only the last stage sees losses; the others report nothing (reports_loss is False)
            return torch.zeros((), device=self.device)
        # The micro-batches' mean loss, divided by the accumulation (``Strategy.forward_backward``'s contract).
        return torch.stack(losses).detach().mean() * (self._loss_divisor(grad_accum) // grad_accum)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> Optional[torch.Tensor]:
        # The norm is over the whole model: add the stages' squared norms before scaling.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        counted = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in self.norm_skip]
        # On the training device on every stage, also one without gradients: all ranks of a collective must send
        # tensors of one device (on a GPU node CPU tensors go through gloo, CUDA ones through NCCL).
        zero = torch.zeros((), device=self.device)
        local = torch.stack([g.detach().float().norm() ** 2 for g in counted]).sum() if counted else zero
        dist.all_reduce(local, group=self.pp_group)
        scale = (max_norm / (local.sqrt() + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return local.sqrt()

    def eval_step(self, task: Task, model: nn.Module, batch: Any) -> Output:
        inputs, targets = task.split(batch)
        ranks = dist.get_process_group_ranks(self.pp_group)
        act = inputs if self.stage.is_first else _recv(ranks[self.stage_index - 1], self.device)
        out = model(act)
        if not self.stage.is_last:
            _send(out, ranks[self.stage_index + 1])
            return Output(loss=torch.zeros((), device=self.device), count=0)
        return task.score(out, targets)

    def model_keys(self, model: nn.Module) -> list[str]:
        return list(self.key_order)

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        local = {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}
        parts: list[Any] = [None] * self.cfg.stages
        dist.all_gather_object(parts, local, group=self.pp_group)
        merged = {k: v for part in parts for k, v in part.items()}
        return {k: merged[k] for k in self.key_order}

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        own = self.unwrap(model).state_dict()
        self.unwrap(model).load_state_dict({k: v for k, v in state.items() if k in own})

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        raise DdpJobError(
            "a pipeline run cannot resume from a full (single-file) checkpoint's optimizer state",
            "resume it under the strategy that wrote it, or export the weights and start a new run",
        )


class StageModule(nn.Module):
    """One stage: its blocks applied in order. The user's model is the registered child, so parameter names (and
    checkpoints) are the plain model's; the blocks (maybe the task's adapters around its submodules) are a plain
    list, not registered, their weights already counted under ``module``."""

    def __init__(self, module: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.module = module
        self.blocks = list(blocks)

    def forward(self, x: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return x


def keep_only(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Drop, in place, the parameters and buffers of ``model`` that none of ``blocks`` holds: they belong to other
    stages. The slots stay (set to None), so the names of what is kept do not change, and no other block runs."""
    params = {id(p) for b in blocks for p in b.parameters()}
    buffers = {id(t) for b in blocks for t in b.buffers()}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in params:
                module.register_parameter(name, None)
        for name, t in list(module.named_buffers(recurse=False)):
            if id(t) not in buffers:
                module.register_buffer(name, None)


def _send(tensor: torch.Tensor, dst: int) -> None:
    # The small header is a CPU tensor (gloo on a GPU node), the activation a device tensor (NCCL).
    header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], dtype=torch.int64)
    dist.send(torch.tensor([len(header)], dtype=torch.int64), dst)
    dist.send(header, dst)
    dist.send(tensor.contiguous(), dst)


def _recv(src: int, device: torch.device) -> torch.Tensor:
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, src)
    header = torch.zeros(int(length), dtype=torch.int64)
    dist.recv(header, src)
    dtype, dims = _DTYPES[int(header[0])], int(header[1])
    out = torch.empty([int(d) for d in header[2 : 2 + dims]], dtype=dtype, device=device)
    dist.recv(out, src)
    return out
