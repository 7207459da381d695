"""The strategy interface: how a model is placed and wrapped, how its state is saved, how data is sharded."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, ContextManager, Optional

import torch
from torch import nn

from ddp_core.cluster.env import DistEnv
from ddp_core.config import StrategyConfig
from ddp_core.distributed.straggler import WorkTimer
from ddp_core.tasks.base import Output, Task


class Strategy(ABC):
    # How this strategy's checkpoints are written: "full" (rank 0 writes the whole state to one file) or
    # "sharded" (every rank writes its part with torch.distributed.checkpoint). Either kind loads into any strategy.
    checkpoint_kind: ClassVar[str] = "full"

    def __init__(self, cfg: StrategyConfig, env: DistEnv, device: torch.device) -> None:
        self.cfg = cfg
        self.env = env
        self.device = device
        self.work = WorkTimer(
            device
        )  # this rank's data wait and forward: the straggler report (ddp_core/distributed/straggler.py)
        # Set by the trainer: where each training micro-batch's Output goes (train/<name> metrics), and the fp16
        # loss scaler (train.precision=fp16) that scales each loss before its backward.
        self.on_train_output: Callable[[Output], None] = lambda out: None
        self.scaler: Optional[torch.amp.GradScaler] = None
        self.task: Optional[Task] = None  # set by build_strategy: Task.pipeline_blocks for the strategies that split

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Place ``model`` on its device(s) and wrap it; the result is what the loop calls."""

    @abstractmethod
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain user module inside a wrapped one (state_dict keys without wrapper prefixes)."""

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """Context for accumulation micro-steps that should skip gradient communication."""
        return contextlib.nullcontext()

    # Whether this rank's losses count in the logged average (a pipeline's last stage only sees losses).
    reports_loss: ClassVar[bool] = True
    # Whether a step's forward and backward meet other processes in collectives (fsdp's gathers, a pipeline's sends):
    # a rank that runs out of memory there leaves its peers waiting, so the attempt ends instead (``trainer.redo``).
    steps_communicate: ClassVar[bool] = False
    # train.invariant's (``strategies.invariant``): a fixed summation tree whose leaves, the micro-batches, decide the
    # bits, which fsdp does not keep.
    invariant: ClassVar[bool] = False

    def forward_backward(self, task: Task, model: nn.Module, batch: Any, grad_accum: int, sync: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch of ``grad_accum``; ``sync`` on the last one, where gradient
        communication happens. Returns the micro-batch's loss / grad_accum for logging: a detached tensor on the
        device, never read back here (a read-back would make the host wait for the GPU every micro-batch)."""
        if not sync:
            with self.no_sync(model):
                return self._forward_backward(task, model, batch, grad_accum)
        return self._forward_backward(task, model, batch, grad_accum)

    def _forward_backward(self, task: Task, model: nn.Module, batch: Any, grad_accum: int) -> torch.Tensor:
        with self.work.forward():
            out = task.compute(model, batch)
        self.on_train_output(out)
        # x / 1 is x, bit for bit, forward and backward: skip the kernel (and its backward) without accumulation.
        loss = out.loss / grad_accum if grad_accum > 1 else out.loss
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach()

    def local_model(self, model: nn.Module) -> nn.Module:
        """The module whose forward and backward hold no collective of another process, for steps that must be able
        to stop in any micro-batch (``trainer.memory``): the model itself unless its wrapper communicates."""
        return model

    def sync_buffers(self, model: nn.Module) -> None:
        """Before a step on ``local_model``: the buffers (batch-norm statistics) as the wrapper's forward would make
        them (ddp: rank 0's). Nothing to do where one process holds them."""
        return None

    def reduce_gradients(self, model: nn.Module) -> None:
        """After micro-batches ran on ``local_model``: every replica's gradients the mean over the replicas. Nothing
        to do where one process sees every sample."""
        return None

    def recompute_activations(self, model: nn.Module) -> bool:
        """From now on, recompute the units' activations of ``model`` (``local_model``) in the backward instead of
        keeping them: activation checkpointing turned on in a running attempt, the lever against an out-of-memory
        that keeps every bit (``trainer.redo``). False where they already are, or where this strategy does not."""
        return False

    def recomputes(self) -> bool:
        """Whether the units' activations are recomputed in the backward now (``strategy.activation_checkpointing``,
        or ``recompute_activations`` since): an out-of-memory's fix then is not to turn it on."""
        return self.cfg.activation_checkpointing

    @property
    def micro_multiple(self) -> int:
        """What every micro-batch must be a multiple of (a pipeline's ``strategy.microbatches``)."""
        return 1

    def probed(self) -> None:
        """After the probe's steps (``trainer.memory``): forget what they fixed for later ones (a pipeline's shapes)."""
        return None

    def begin_step(self, step: int) -> None:
        """Called before each optimizer step's micro-batches with the step's number (0-based, counted over the
        run): ``train.invariant`` seeds each micro-batch shard from it."""
        return None

    def prime(self, task: Task, model: nn.Module, batch: Any) -> None:
        """Called once per attempt, before its first step, with that step's first micro-batch: work that must not
        change the model, its gradients or the RNG streams, only how later steps run (see ``DDPStrategy.prime``)."""
        return None

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> Optional[torch.Tensor]:
        """Clip the whole model's gradient norm to ``max_norm``; returns the norm before clipping (a device
        tensor, not read back)."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def eval_step(self, task: Task, model: nn.Module, batch: Any) -> Output:
        """Loss and metric sums of one eval batch (under no_grad); ranks without outputs return count 0."""
        return task.compute(model, batch)

    @property
    def data_rank(self) -> int:
        """This process's index among data-parallel replicas (sampler shard)."""
        return self.env.rank

    @property
    def data_world(self) -> int:
        """Number of data-parallel replicas; the global batch is batch_size * data_world * grad_accum."""
        return self.env.world_size

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's weights under plain keys, for a full checkpoint (called on rank 0 only)."""
        return self.unwrap(model).state_dict()

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full checkpoint's weights (every rank holds the whole ``state``)."""
        self.unwrap(model).load_state_dict(state)

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a full checkpoint's ``optimizer.state_dict()`` (every rank holds all of it)."""
        optimizer.load_state_dict(state)

    def model_keys(self, model: nn.Module) -> list[str]:
        """The whole model's parameter names in state_dict order (also where this rank holds only some)."""
        return list(self.unwrap(model).state_dict())

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights under plain keys on every rank; collective for strategies that shard.
        Comparable across ranks, strategies and world sizes (the trainer's final weights digest)."""
        return self.unwrap(model).state_dict()

    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's model and optimizer state for torch.distributed.checkpoint, keyed by parameter names
        (DCP saves each rank's shards and reshards them on load). A replicated model gives full tensors."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # DCP: only runs that use it import it

        model_state, optim_state = get_state_dict(self.unwrap(model), optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def load_sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Apply what ``sharded_state`` gave, filled from a sharded checkpoint."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.unwrap(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )


class SingleProcessStrategy(Strategy):
    """A strategy whose one process per node sees every sample (it may drive several GPUs itself)."""

    @property
    def data_rank(self) -> int:
        return 0

    @property
    def data_world(self) -> int:
        return 1
