"""Pipeline parallelism (torch.distributed.pipelining): the model's top-level layers cut into stages across
ranks, micro-batches flowing through them under a GPipe or 1F1B schedule, combined with data parallelism.

Ranks form a 2-D mesh (dp x pp): rank = replica * stages + stage. Every rank builds the whole
``nn.Sequential`` (same seed, so the same weights) and replaces the layers of other stages with
``nn.Identity``: parameter names stay those of the plain model, so sharded checkpoints, export and the
final digest line up with every other strategy. Gradients of one stage are averaged over its dp
replicas after the schedule's backward. Eval runs forward only, stage to stage, with explicit shapes
(eval batches need not divide into micro-batches).
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
from ddp_core.task import Output, Task

log = logging.getLogger(__name__)
_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.float64]


class PipelineStrategy(Strategy):
    checkpoint_kind = "sharded"

    def wrap(self, model: nn.Module) -> nn.Module:
        if not isinstance(model, nn.Sequential) or len(model) == 0:
            raise DdpJobError(
                f"strategy.name='pipeline' needs an nn.Sequential of top-level blocks; got {type(model).__name__}",
                "build the model as nn.Sequential, or use strategy.name=ddp or fsdp",
            )
        stages, world = self.cfg.stages, self.env.world_size
        if len(model) < stages:
            raise DdpJobError(
                f"config key 'strategy.stages' = {stages} exceeds the model's {len(model)} top-level layers",
                f"use strategy.stages<={len(model)}",
            )
        self.mesh = init_device_mesh(self.device.type, (world // stages, stages), mesh_dim_names=("dp", "pp"))
        self.pp_group, self.dp_group = self.mesh["pp"].get_group(), self.mesh["dp"].get_group()
        self.stage_index, self.replica = self.env.rank % stages, self.env.rank // stages
        self.key_order = list(model.state_dict())
        counts = self.cfg.split or balanced_split(
            [sum(p.numel() for p in layer.parameters()) for layer in model], stages
        )
        if sum(counts) != len(model) or len(counts) != stages:
            raise DdpJobError(
                f"config key 'strategy.split' = {counts} must have {stages} entries summing to {len(model)} layers",
                "fix strategy.split or leave it null (balanced by parameter count)",
            )
        first = sum(counts[: self.stage_index])
        owned = range(first, first + counts[self.stage_index])
        for i in range(len(model)):
            if i not in owned:
                model[i] = nn.Identity()  # keeps the other layers' indices, hence the plain parameter names
        model = model.to(self.device)
        self.stage = PipelineStage(model, self.stage_index, stages, self.device, group=self.pp_group)
        log.info("pipeline: stage %d/%d holds layers %d-%d; replica %d/%d; %s schedule, %d micro-batches",
                 self.stage_index, stages, owned.start, owned.stop - 1, self.replica, world // stages,
                 self.cfg.schedule, self.cfg.microbatches)  # fmt: skip
        self._schedule: Optional[Any] = None
        self._scored: list[Output] = []  # what loss_fn scored during the current step (train/<name> metrics)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    @property
    def data_rank(self) -> int:
        return self.env.rank // self.cfg.stages  # every stage of a replica sees the same batch

    @property
    def data_world(self) -> int:
        return self.env.world_size // self.cfg.stages

    @property
    def reports_loss(self) -> bool:  # type: ignore[override]
        return self.stage.is_last

    def _schedule_for(self, task: Task, grad_accum: int) -> Any:
        if self._schedule is None:
            # The schedule averages over micro-batches; accumulation steps divide once more.
            def loss_fn(output: Any, target: Any) -> torch.Tensor:
                out = task.score(output, target)
                self._scored.append(out)
                return out.loss / grad_accum

            self._schedule = _SCHEDULES[self.cfg.schedule](self.stage, self.cfg.microbatches, loss_fn=loss_fn)
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
        return torch.stack(losses).detach().mean()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> Optional[torch.Tensor]:
        # The norm is over the whole model: add the stages' squared norms before scaling.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        # On the training device on every stage, also one without gradients: all ranks of a collective must send
        # tensors of one device (on a GPU node CPU tensors go through gloo, CUDA ones through NCCL).
        zero = torch.zeros((), device=self.device)
        local = torch.stack([g.detach().float().norm() ** 2 for g in grads]).sum() if grads else zero
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
        local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        parts: list[Any] = [None] * self.cfg.stages
        dist.all_gather_object(parts, local, group=self.pp_group)
        merged = {k: v for part in parts for k, v in part.items()}
        return {k: merged[k] for k in self.key_order}

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        own = model.state_dict()
        model.load_state_dict({k: v for k, v in state.items() if k in own})

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        raise DdpJobError(
            "a pipeline run cannot resume from a full (single-file) checkpoint's optimizer state",
            "resume it under the strategy that wrote it, or export the weights and start a new run",
        )


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
