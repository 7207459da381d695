"""The training loop, top to bottom: build, resume, train with periodic eval/log/checkpoint, finish.

Every strategy runs through this one loop. Position in the data is (epoch, micro-batches consumed in the
epoch), saved in each checkpoint with every rank's RNG states (and a streaming loader's state), so a resumed run
continues the exact stream it stopped in. Optional parts are components the loop calls in one line each: the
optimizer step (``optim.OptimizerStep``: fp16 scaling, clipping, grad norm), train metrics (``train_metrics``), the
monitored metric (``monitor``: best checkpoint, early stopping) and what rides along in checkpoints
(``train_state``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from ddp_core.checkpoint import full as full_checkpoint
from ddp_core.checkpoint import store as checkpoint
from ddp_core.checkpoint.train_state import Carried, Position
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.preemption import StopFlag
from ddp_core.config import Config, Precision, to_dict
from ddp_core.dist import groups as distributed
from ddp_core.dist import straggler
from ddp_core.errors import DdpJobError
from ddp_core.run.reporting import MetricsLog, Progress
from ddp_core.run.rundir import RunDir
from ddp_core.search import pruning
from ddp_core.strategies import Strategy, build_strategy
from ddp_core.tasks.base import Task, load_task
from ddp_core.trainer.data import TrainData, eval_loader
from ddp_core.trainer.metrics import TrainSums
from ddp_core.trainer.monitor import Monitor
from ddp_core.trainer.optim import OptimizerStep, build_optimizer, build_scheduler, keeps_implementation
from ddp_core.trainer.wandb_run import WandbRun
from ddp_core.trainer.watchdog import Watchdog

if TYPE_CHECKING:
    from ddp_core.checkpoint.sharded import ShardedWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    step: int
    final: Optional[dict[str, float]]  # eval metrics when the run finished
    signum: int = 0  # the signal the ranks agreed to stop on; 0 when finished
    pruned: bool = False  # a trial of an adaptive sweep that its study's pruner stopped early (final is None)
    early_stopped: bool = False  # finished before max_steps: checkpoint.monitor stopped improving


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch  # the loader's batches are on the CPU already: .to() would return each tensor itself
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def autocast(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if cfg.train.precision is Precision.bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if cfg.train.precision is Precision.fp16:
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def evaluate(task: Task, model: nn.Module, loader: Any, cfg: Config, strategy: Strategy) -> dict[str, float]:
    sums: dict[str, torch.Tensor] = {}  # on the device: read back once, after the last batch
    count = 0
    model.eval()
    with torch.no_grad(), autocast(cfg, strategy.device):
        for batch in itertools.islice(loader, cfg.train.eval_batches or None):  # train.eval_batches: a cap per rank
            out = strategy.eval_step(task, model, to_device(batch, strategy.device))
            count += out.count
            for key, value in out.sums.items():
                value = value.detach().double()
                sums[key] = sums[key] + value if key in sums else value
    model.train()
    # Ranks without outputs (a pipeline's first stages) have no metric names yet: agree on them first.
    keys = distributed.union_keys(sorted(sums))
    zero = torch.zeros((), dtype=torch.float64, device=strategy.device)
    local = torch.stack([zero + count] + [sums.get(k, zero) for k in keys]).cpu()  # the one read-back
    totals = distributed.all_reduce_sum(local)  # host totals: gloo
    return {k: (totals[i + 1] / totals[0]).item() for i, k in enumerate(keys)}


class RunningLoss:
    """The step losses since the last progress line, kept as the device tensors ``forward_backward`` returned: no
    arithmetic per micro-batch (an in-place add costs a kernel launch, ~4 us on a CPU, each time), and the host
    reads them back in one transfer when a line is due (``log_every``) or a checkpoint is written.

    The sum is taken in float64, one loss after the other in the order they came, onto the total of earlier read-backs:
    the same value whether or not a checkpoint (which folds the pending ones) fell inside the interval."""

    def __init__(self) -> None:
        self.total = 0.0  # float64 sum of the losses already read back
        self.pending: list[torch.Tensor] = []  # losses not read back yet (on the training device)
        self.steps = 0  # steps whose loss this rank saw (a pipeline's last stage only)

    def add(self, step_loss: torch.Tensor, counts: bool) -> None:
        self.pending.append(step_loss)
        self.steps += counts

    def _fold(self) -> None:
        if self.pending:
            for value in torch.stack(self.pending).tolist():  # the one read-back (a host-device sync)
                self.total += value
            self.pending.clear()

    def state(self) -> torch.Tensor:
        """(sum, steps) as a CPU float64 tensor: the form checkpoints hold."""
        self._fold()
        return torch.tensor([self.total, float(self.steps)], dtype=torch.float64)

    def load(self, state: torch.Tensor) -> None:
        self.total, self.steps, self.pending = float(state[0]), int(state[1]), []

    def reset(self) -> None:
        self.total, self.steps, self.pending = 0.0, 0, []


def micro_batches(loader: Any, grad_accum: int) -> Iterator[list[Any]]:
    """Groups of ``grad_accum`` micro-batches; a short tail at the epoch's end is dropped."""
    group: list[Any] = []
    for batch in loader:
        group.append(batch)
        if len(group) == grad_accum:
            yield group
            group = []


def save_checkpoint(
    cfg: Config,
    run_dir: RunDir,
    env: DistEnv,
    strategy: Strategy,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    pos: Position,
    log_loss: RunningLoss,
    sharded: Optional[ShardedWriter] = None,
    full: Optional[full_checkpoint.FullWriter] = None,
    sync: bool = False,
    carried: Optional[Carried] = None,
) -> float:
    """Collective: every rank's RNG to rank 0, then rank 0 writes the whole state (full: through ``full``, rank 0's
    writer, in the background if it is async and not ``sync``), or every rank its shard (``sharded`` given).
    Returns the seconds training blocked."""
    started = time.perf_counter()
    rngs = distributed.gather_to_main(distributed.rng_state(), env)
    rest = {
        "scheduler": scheduler.state_dict(),
        "position": asdict(pos),
        "log_loss": log_loss.state(),  # the partial average of the next progress line
        "rng": rngs,
        "world_size": env.world_size,
        "config": to_dict(cfg),
    } | (carried.state(env) if carried is not None else {})
    if sharded is not None:
        # The whole model's parameter names, in order: rank 0 may hold only part of them (a pipeline stage).
        rest["model_keys"] = strategy.model_keys(model)
        sharded.save(pos.step, strategy.sharded_state(model, optimizer), rest if env.is_main else None)
        return time.perf_counter() - started
    if env.is_main:
        state = {"model": strategy.model_state(model), "optimizer": optimizer.state_dict(), **rest}
        assert full is not None, "rank 0 writes full checkpoints through its FullWriter"
        full.save(pos.step, state, sync=sync)
    distributed.barrier()  # nobody runs ahead (or exits) before the checkpoint is durable, or copied (async)
    return time.perf_counter() - started


def load_checkpoint(
    info: checkpoint.CheckpointInfo, strategy: Strategy, model: nn.Module, optimizer: Any
) -> dict[str, Any]:
    """Collective: restore model and optimizer from either kind of checkpoint, under any strategy. Returns the
    rest of it (scheduler, position, RNG, ...)."""
    if info.kind == checkpoint.SHARDED:
        from ddp_core.checkpoint import sharded as sharded_checkpoint  # DCP: imported by the runs that use it

        state, rest = sharded_checkpoint.load(info, strategy.sharded_state(model, optimizer))
        strategy.load_sharded_state(model, optimizer, state)
        return rest
    state = checkpoint.load(info)
    strategy.load_model_state(model, state["model"])
    strategy.load_optimizer_state(model, optimizer, state["optimizer"])
    return state


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over a full state dict in its order (``Strategy.full_model_state``): equal digests mean bitwise-equal
    weights."""
    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def apply_determinism(cfg: Config, device: torch.device) -> None:
    """``train.deterministic`` for this process's kernels."""
    if cfg.train.deterministic and device.type == "cuda" and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        # use_deterministic_algorithms raises at the first cuBLAS call otherwise, after the queue wait.
        raise DdpJobError(
            "train.deterministic=true on a GPU needs CUBLAS_WORKSPACE_CONFIG in the environment",
            "submit through ddpjob (it exports it), or export CUBLAS_WORKSPACE_CONFIG=:4096:8",
        )
    if torch.are_deterministic_algorithms_enabled() != cfg.train.deterministic:
        # Only on a change: the call imports torch._inductor.config, i.e. all of dynamo (1.5-2 s here), which a run
        # without DDP, FSDP or compile never needs.
        torch.use_deterministic_algorithms(cfg.train.deterministic)


def train(cfg: Config, run_dir: RunDir, env: DistEnv, stop_flag: StopFlag, watchdog: Watchdog) -> Outcome:
    device = distributed.setup(env, cfg.dist)
    apply_determinism(cfg, device)

    # Same seed on every rank for the model's initial weights; per-rank seeds for dropout etc. after.
    distributed.seed_all(cfg.train.seed)
    task = load_task(cfg.task)
    strategy = build_strategy(cfg.strategy, env, device, task)
    model = task.build_model(**cfg.task.model)
    if cfg.train.compile:  # in place, before wrapping: parameter names (checkpoint keys) stay the plain model's
        model.compile()
    model = strategy.wrap(model)
    optimizer = build_optimizer(cfg.optim, model, task)
    scheduler = build_scheduler(cfg.optim, optimizer, cfg.train.max_steps, task)
    train_set, eval_set = task.build_datasets()
    pin = device.type == "cuda"  # page-locked host batches: the copy to the GPU runs without blocking the host
    collate = task.collate_fn if type(task).collate_fn is not Task.collate_fn else None  # None: the loader's own
    data = TrainData(train_set, strategy.data_rank, strategy.data_world, cfg.data, cfg.train.grad_accum,
                     cfg.train.seed, pin, collate)  # fmt: skip
    evals = eval_loader(eval_set, strategy.data_rank, strategy.data_world, cfg.data, pin, collate)
    distributed.seed_all(cfg.train.seed * 1000 + env.rank + 1)
    train_sums = TrainSums()  # train/<name> from the task's Output.sums, train/grad_norm
    strategy.on_train_output = train_sums.add
    strategy.scaler = torch.amp.GradScaler(device.type) if cfg.train.precision is Precision.fp16 else None
    step_optimizer = OptimizerStep(optimizer, scheduler, cfg.optim.grad_clip, cfg.train.log_grad_norm,
                                   strategy.scaler, train_sums.add_grad_norm,
                                   functools.partial(strategy.clip_grad_norm, model))  # fmt: skip
    monitor = Monitor(cfg.checkpoint.monitor, cfg.train.early_stop_patience)
    carried = Carried(shared={"monitor": monitor, "scaler": step_optimizer},
                      per_rank={"data": data, "train_sums": train_sums})  # fmt: skip

    pos = Position()
    log_loss = RunningLoss()
    latest = checkpoint.find_latest_agreed(run_dir.checkpoints)
    if latest is not None:
        with keeps_implementation(optimizer):  # optim.implementation is this attempt's, not the checkpoint's
            state = load_checkpoint(latest, strategy, model, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        pos = Position(**state["position"])
        log_loss.load(state["log_loss"])
        carried.load(state, env)
        if state["world_size"] == env.world_size:
            distributed.set_rng_state(state["rng"][env.rank])
        else:
            log.warning(
                "checkpoint was written at world size %d, now %d: RNG streams restart",
                state["world_size"],
                env.world_size,
            )
        log.info("resumed from %s (step %d, epoch %d)", latest.path.name, pos.step, pos.epoch)

    if env.is_main:
        run_dir.log_event(
            "start", job_id=env.job_id, restart_count=env.restart_count, step=pos.step, world_size=env.world_size
        )
    metrics_log = MetricsLog(run_dir.metrics_file, pos.step) if env.is_main else None
    # Steps an earlier attempt already sent to W&B (it died after its last checkpoint) are not sent again:
    # W&B steps stay strictly increasing across attempts; the local metrics log was rewound instead.
    wandb_run = WandbRun(
        cfg.wandb,
        run_dir,
        run_dir.read_meta().get("run_id", run_dir.name),
        to_dict(cfg),
        enabled=env.is_main,
        skip_through=metrics_log.previous_last_step if metrics_log else -1,
    )
    hosts: list[str] = []  # for the straggler report: which host the slowest rank is on (at the first line)
    spreads: list[dict[str, Any]] = []  # the ranks' work per step, one entry per progress line
    samples_per_step = cfg.data.batch_size * cfg.train.grad_accum * strategy.data_world
    progress = Progress(pos.step, cfg.train.max_steps, samples_per_step, enabled=env.is_main)
    trial = pruning.reporter(cfg.trial, env.is_main)  # rank 0 of an adaptive sweep's trial; None otherwise

    def record(split: str, metrics: dict[str, float], step: Optional[int] = None) -> None:
        """Metrics of ``step`` (default: the current one) to the metrics log and W&B."""
        step = pos.step if step is None else step
        if metrics_log is not None:
            metrics_log.write(step, split, metrics)
        wandb_run.log({f"{split}/{k}": v for k, v in metrics.items()}, step=step)

    started = time.perf_counter()
    last_save_s, saved_step = 0.0, -1
    logged_at, logged_step = started, pos.step  # the last progress line: step time is measured between lines
    sharded: Optional[ShardedWriter] = None
    full: Optional[full_checkpoint.FullWriter] = None
    if strategy.checkpoint_kind == checkpoint.SHARDED:
        from ddp_core.checkpoint.sharded import ShardedWriter

        sharded = ShardedWriter(
            run_dir.checkpoints, cfg.checkpoint.keep_last, cfg.checkpoint.async_save, env.rank, env.world_size
        )
    elif env.is_main:
        full = full_checkpoint.FullWriter(
            run_dir.checkpoints, cfg.checkpoint.keep_last, cfg.checkpoint.async_save, optimizer=optimizer
        )

    def checkpoint_now(sync: bool = False) -> None:
        """``sync``: a full checkpoint is complete when this returns (a signal's, the last one)."""
        nonlocal last_save_s, saved_step
        finish_line()  # its loss is checked (train.stop_on_nan) and logged before the checkpoint that follows it
        if saved_step != pos.step:
            if metrics_log is not None:
                metrics_log.sync()
            with watchdog.allowance():  # a save of a large model may take longer than a step may stall
                last_save_s = save_checkpoint(cfg, run_dir, env, strategy, model, optimizer, scheduler, pos,
                                              log_loss, sharded, full, sync, carried)  # fmt: skip
            saved_step = pos.step
            if env.is_main:
                log.info("training blocked %.3f s for the checkpoint of step %d", last_save_s, pos.step)
            # write_s: what the last completed save cost from start to manifest, i.e. what a signal's
            # synchronous save costs (save_s is far less for a background save).
            written = {"write_s": round(full.last_write_s, 4)} if full is not None and full.last_write_s else {}
            record("checkpoint", {"save_s": round(last_save_s, 4)} | written)

    def sigterm_save_cost() -> float:
        """Rank 0's cost of a synchronous save (as long as the last complete one took), on every rank: whether it
        fits in checkpoint.sigterm_budget_s must be one answer, the save is collective."""
        cost = max(last_save_s, full.last_write_s or 0.0) if full is not None else last_save_s
        return distributed.all_gather_floats([cost])[0][0]

    def close_writers() -> None:
        for writer in (sharded, full):
            if writer is not None:
                writer.close()  # an async save completes before the requeue (and the process group)

    line: Optional[tuple[int, dict[str, float], Callable[[], list[list[float]]]]] = None  # (step, metrics, gather)

    def start_line() -> None:
        """The progress line of this step, gathered in the background: every rank's (loss sum, steps, peak GPU
        memory, work per step, train sums) go out in one all-gather that gloo's thread runs while the ranks go on
        with the next step, and ``finish_line`` writes the line after it (a blocking gather here cost 1.2-1.8 ms
        per line on 2 CPU ranks, 1.5% of the tiny model's steps at log_every 25)."""
        nonlocal line, logged_at, logged_step
        assert line is None, "the loop finishes the last line before it starts the next"
        # The loss read-back synchronises with the device first: the forward timings' events have completed.
        state = log_loss.state().tolist()  # the interval's only host-device sync
        work_ms = strategy.work.take_ms() / max(1, pos.step - logged_step)
        values = [*state, distributed.peak_memory_gb(device) or 0, work_ms, *train_sums.take()]
        log_loss.reset()
        now = time.perf_counter()
        known = {"lr": scheduler.get_last_lr()[0], "step_ms": 1000 * (now - logged_at) / max(1, pos.step - logged_step)}
        line = (pos.step, known, distributed.all_gather_floats_async(values))
        logged_at, logged_step = now, pos.step

    def finish_line() -> None:
        """Write the progress line in flight, if any: at the step after it, and before anything that reads the
        metrics log or the loss (an evaluation, a checkpoint, the end)."""
        nonlocal line
        if line is None:
            return
        step, known, gather = line
        line = None
        ranks = gather()
        metrics = {"loss": sum(r[0] for r in ranks) / max(1.0, sum(r[1] for r in ranks)), **known}
        # The task's train-step sums and the grad norm, averaged over ranks; train/loss stays the step losses' mean.
        metrics |= {k: v for k, v in train_sums.combine([r[4:] for r in ranks]).items() if k not in metrics}
        if device.type == "cuda":  # the largest and smallest peak over ranks: imbalance shows as a gap
            metrics |= {"peak_mem_gb": max(r[2] for r in ranks), "peak_mem_gb_min": min(r[2] for r in ranks)}
        progress.update(step, metrics)
        if len(ranks) > 1 and not hosts:
            hosts.extend(distributed.hosts())  # every rank is at this line: one object all-gather per attempt
        spread = straggler.spread([r[3] for r in ranks], hosts) if len(ranks) > 1 else {}
        if spread:
            spreads.append(spread | {"step_ms": metrics["step_ms"]})
            del spreads[: -straggler.LINES]
            slow = straggler.persistent(spreads, cfg.train.straggler_factor)
            if slow is not None:
                spread["straggler_rank"] = slow
            if slow is not None and env.is_main:
                log.warning("rank %d on %s is a straggler: %.1f ms of its own work per step, median %.1f",
                            slow, hosts[slow], spread["work_ms_max"], spread["work_ms_median"])  # fmt: skip
        record("train", metrics | {"samples_per_s": progress.rate(step)[1]} | spread, step)
        if cfg.train.stop_on_nan and not math.isfinite(metrics["loss"]):
            # Every rank read the same gathered loss: all of them stop here, none is left in a collective, and
            # none has saved a checkpoint since (checkpoint_now finishes the line first).
            raise DdpJobError(
                f"the training loss became {metrics['loss']} by step {step}",
                "lower optim.lr, set optim.grad_clip or warmup; the last checkpoint is from before it "
                "(train.stop_on_nan=false trains on)",
            )

    def evaluate_now() -> dict[str, float]:
        """Evaluate, log, and keep this step's checkpoint as the best when checkpoint.monitor improved."""
        finish_line()
        with watchdog.allowance():
            metrics = evaluate(task, model, evals, cfg, strategy)
        record("eval", metrics)
        if monitor.update(pos.step, metrics):
            checkpoint_now(sync=pos.step == cfg.train.max_steps)
            assert monitor.best is not None  # update() just set it
            if env.is_main:
                checkpoint.mark_best(run_dir.checkpoints, pos.step, str(cfg.checkpoint.monitor), monitor.best)
        return metrics

    model.train()
    primed = False
    pruned = False  # an adaptive sweep's pruner stopped this trial (ddp_core.search.pruning)
    last_eval: Optional[dict[str, float]] = None  # an early stop's final metrics: the evaluation that decided it
    amp = autocast(cfg, device)  # one context, entered once per micro-batch (never nested)
    while pos.step < cfg.train.max_steps and not monitor.should_stop and not pruned:
        for group in strategy.work.timed(micro_batches(data.epoch(pos), cfg.train.grad_accum)):
            if not primed:  # this attempt's first step: every attempt's steps run alike (DDPStrategy.prime)
                with amp:
                    strategy.prime(task, model, to_device(group[0], device))
                primed = True
            for i, batch in enumerate(group):
                with amp:
                    sync = i == len(group) - 1  # gradients are communicated on the last micro-batch only
                    loss = strategy.forward_backward(task, model, to_device(batch, device), cfg.train.grad_accum, sync)
                log_loss.add(loss, counts=strategy.reports_loss and i == 0)
            step_optimizer()
            pos.step += 1
            pos.micro_in_epoch += len(group)
            watchdog.beat(pos.step)

            finish_line()  # the last step's, if it had one
            if pos.step % cfg.train.log_every == 0 or pos.step == cfg.train.max_steps:
                start_line()
            if cfg.train.eval_every and pos.step % cfg.train.eval_every == 0 and pos.step < cfg.train.max_steps:
                last_eval = evaluate_now()
                pruned = cfg.trial.bound and pruning.decide(trial, pos.step, last_eval)
                if pruned:
                    break
            if (
                cfg.checkpoint.every_steps
                and pos.step % cfg.checkpoint.every_steps == 0
                and pos.step < cfg.train.max_steps
            ):
                checkpoint_now()
            signum = stop_flag.agree()  # every step: all ranks stop after the same one
            if signum:
                cost = sigterm_save_cost() if signum == signal.SIGTERM else 0.0
                if cost <= cfg.checkpoint.sigterm_budget_s:
                    checkpoint_now(sync=True)
                else:
                    log.warning("SIGTERM: the last save took %.1f s, over checkpoint.sigterm_budget_s", cost)
                log.info("stopping at step %d on %s", pos.step, signal.Signals(signum).name)
                finish_line()
                close_writers()
                stop_flag.settle()
                progress.close()
                wandb_run.finish()
                return Outcome(step=pos.step, final=None, signum=signum)
            if pos.step >= cfg.train.max_steps or monitor.should_stop:
                break

    stop_flag.settle()  # a signal in the last step is moot: the run is complete (or pruned)
    final: Optional[dict[str, float]] = None  # a pruned trial has none: its study already has its evals
    if monitor.should_stop and last_eval is not None:
        final = last_eval
        log.info("early stop at step %d: %s has not improved on %.6g (step %d) for %d evaluations", pos.step,
                 cfg.checkpoint.monitor, monitor.best, monitor.best_step, monitor.stale)  # fmt: skip
    elif not pruned:
        final = evaluate_now()
    checkpoint_now(sync=True)
    close_writers()
    progress.close()
    elapsed = time.perf_counter() - started
    scores = " ".join(f"{k} {v:.4f}" for k, v in (final or {}).items())
    log.info("%s at step %d in %.1f s: %s", "pruned" if pruned else "finished", pos.step, elapsed, scores)
    peak = distributed.peak_memory_gb(device)
    if peak is not None:
        log.info("peak GPU memory on %s: %.2f GB allocated by tensors", device, peak)
    # Every rank logs its own digest: replicas that drifted apart show up as different lines.
    log.info("final weights sha256 %s", weights_digest(strategy.full_model_state(model)))
    wandb_run.finish()
    return Outcome(step=pos.step, final=final, pruned=pruned, early_stopped=monitor.should_stop)
