"""The built-in trainer: ``Trainer.fit`` builds, resumes, trains with periodic eval/log/checkpoint, and finishes.

Every strategy runs through this one loop (``Trainer.train``, one screen). Position in the data is (epoch,
samples of the epoch's global stream consumed), saved in each checkpoint with every rank's RNG states (and a
streaming loader's state), so a resumed run continues the exact stream it stopped in, at any world size. Each
optimizer step takes ``grad_accum`` micro-batches per replica: ``train.grad_accum``, or derived from
``data.global_batch_size`` and this attempt's replicas (``config.batch``); under ``train.invariant`` the strategy
seeds and sums each micro-batch shard itself (``strategies.invariant``; ``begin_step`` gives it the step). The
components are called in one line each: the optimizer step (``optim.OptimizerStep``: fp16 scaling, clipping, grad
norm), the progress lines and records (``progress``), the monitored metric (``monitor``: best checkpoint, early
stopping), the checkpoints (``checkpoint.manager.CheckpointManager``, saving the ``TrainState``), the pruner of an
adaptive sweep's trial.

``fit`` returns through one path. Its teardown (writers, progress, the trackers) runs on success, on a signal's stop
and on an exception alike, and holds no collective: a failed rank's peers may be gone.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import time
from typing import Any, Optional

import torch

from ddp_core.checkpoint.manager import CheckpointManager, Restored
from ddp_core.checkpoint.train_state import Carried, TrainState
from ddp_core.cluster import batch_node, deadline, failures, health, rendezvous
from ddp_core.cluster.env import DistEnv, process_started
from ddp_core.cluster.preemption import StopFlag
from ddp_core.config import Config, Precision, to_dict
from ddp_core.config.batch import fixed_micro, grad_accum, is_auto, per_replica
from ddp_core.distributed import groups, rng
from ddp_core.run.rundir import RunDir
from ddp_core.search import pruning
from ddp_core.strategies import build_strategy
from ddp_core.strategies.invariant import log_invariance
from ddp_core.tasks.base import Task, load_task
from ddp_core.trainer import memory, redo
from ddp_core.trainer.data import TrainData, eval_loader
from ddp_core.trainer.metrics import RunningLoss, TrainSums
from ddp_core.trainer.monitor import Monitor
from ddp_core.trainer.optim import OptimizerStep, build_optimizer, build_scheduler, keeps_implementation
from ddp_core.trainer.profiling import Profiler
from ddp_core.trainer.progress import ProgressLines, Records
from ddp_core.trainer.steps import (
    Outcome,
    apply_determinism,
    autocast,
    evaluate,
    micro_batches,
    to_device,
    weights_digest,
)
from ddp_core.trainer.telemetry import Telemetry
from ddp_core.trainer.watchdog import Watchdog

log = logging.getLogger(__name__)


class Trainer:
    """One attempt of a run on this rank. ``fit`` is the whole of it; the rest are its named parts."""

    def __init__(self, cfg: Config, run_dir: RunDir, env: DistEnv, stop_flag: StopFlag, watchdog: Watchdog) -> None:
        self.cfg, self.run_dir, self.env = cfg, run_dir, env
        self.stop_flag, self.watchdog = stop_flag, watchdog
        # Built by build(), resume() and start(): fit's teardown closes whichever exist.
        self.checkpoints: Optional[CheckpointManager] = None
        self.records: Optional[Records] = None
        self.lines: Optional[ProgressLines] = None
        self.batch_watch: Optional[batch_node.Watch] = None  # rank 0 with spare nodes; elastic: node 1's (start)
        self.profiler: Optional[Profiler] = None
        self.primed = False  # this attempt's first step done (``Strategy.prime``)
        self.restored: Optional[Restored] = None  # the checkpoint tier and step this attempt started from
        self.resumed = False  # resume() done: the train state's step is the run's (before it, 0 for any attempt)
        self.interrupted = False  # stopped on a signal, to be continued (what the trackers record at the end)

    def fit(self) -> Outcome:
        error: Optional[BaseException] = None
        try:
            self.build()
            self.resume()
            self.start()
            outcome = self.train()
        except BaseException as err:
            error = err
            if failures.out_of_memory(err) and not isinstance(err, memory.OutOfMemory):  # said with the numbers
                device, invariant = getattr(self, "device", torch.device("cpu")), self.cfg.train.invariant
                error = memory.ran_out(err, self.at_step(), device, invariant)
                raise error from err
            raise
        finally:
            self.close(error)
        return outcome

    def at_step(self) -> Optional[int]:
        """The step this rank has reached; None before the attempt resumed (a failure in build, the probe, resume)."""
        return self.state.pos.step if self.resumed else None

    def build(self) -> None:
        """Device, model, optimizer, schedule, data and the components around them, on every rank."""
        cfg, env = self.cfg, self.env
        # Before the rendezvous: a rank on a bad node leaves at once, and srun's --kill-on-bad-exit ends the others.
        health.check_node(self.run_dir, env, cfg.slurm.health_check)
        self.device = device = groups.setup(env, cfg.dist, rendezvous.meeting_file(self.run_dir.path, env))
        groups.check_health(device, env)
        apply_determinism(cfg, device)
        self.amp = autocast(cfg, device)  # one context, entered once per micro-batch (never nested)
        # Same seed on every rank for the model's initial weights; per-rank seeds for dropout etc. after.
        rng.seed_all(cfg.train.seed)
        self.task = task = load_task(cfg.task)
        invariant_seed = cfg.train.seed if cfg.train.invariant else None  # world-size-invariant shards, seeded
        self.strategy = strategy = build_strategy(cfg.strategy, env, device, task, invariant_seed)
        model = task.build_model(**cfg.task.model)
        self.telemetry = Telemetry(cfg, env, device, task, model)  # the task's FLOPs of the plain model, on the CPU
        if cfg.train.compile:  # in place, before wrapping: parameter names (checkpoint keys) stay the plain model's
            model.compile()
        self.model = model = strategy.wrap(model)
        self.optimizer = optimizer = build_optimizer(cfg.optim, model, task)
        scheduler = build_scheduler(cfg.optim, optimizer, cfg.train.max_steps, task)
        # Micro-batches per replica per step: with data.global_batch_size, this attempt's share of the fixed batch.
        # data.batch_size=auto: the share is loaded whole, and cut into the micro-batch that fits (trainer.memory).
        share = per_replica(cfg.data, strategy.data_world, "this attempt") if is_auto(cfg.data) else None
        data_cfg = cfg.data if share is None else dataclasses.replace(cfg.data, batch_size=share)
        self.grad_accum = grad_accum(data_cfg, cfg.train, strategy.data_world, "this attempt")
        train_set, eval_set = task.build_datasets()
        pin = device.type == "cuda"  # page-locked host batches: the copy to the GPU runs without blocking the host
        collate = task.collate_fn if type(task).collate_fn is not Task.collate_fn else None  # None: the loader's own
        self.data = TrainData(
            train_set,
            strategy.data_rank,
            strategy.data_world,
            data_cfg,
            self.grad_accum,
            cfg.train.seed,
            pin,
            collate,
            blocks=cfg.train.invariant,
        )
        self.evals = eval_loader(eval_set, strategy.data_rank, strategy.data_world, cfg.data, pin, collate)
        rng.seed_all(cfg.train.seed * 1000 + env.rank + 1)
        self.train_sums = TrainSums()  # train/<name> from the task's Output.sums, train/grad_norm
        strategy.on_train_output = self.train_sums.add
        strategy.scaler = torch.amp.GradScaler(device.type) if cfg.train.precision is Precision.fp16 else None
        self.step_optimizer = OptimizerStep(
            optimizer,
            scheduler,
            cfg.optim.grad_clip,
            cfg.train.log_grad_norm,
            strategy.scaler,
            self.train_sums.add_grad_norm,
            functools.partial(strategy.clip_grad_norm, model),
        )
        self.monitor = Monitor(cfg.checkpoint.monitor, cfg.train.early_stop_patience)
        carried = Carried(
            shared={"monitor": self.monitor, "scaler": self.step_optimizer},
            per_rank={"data": self.data, "train_sums": self.train_sums},
        )
        self.log_loss = RunningLoss()
        self.state = TrainState(scheduler, self.log_loss, carried, to_dict(cfg))
        self.checkpoints = CheckpointManager(cfg.checkpoint, self.run_dir, env, strategy, model, optimizer)
        self.trial = pruning.reporter(cfg.trial, env.is_main)  # rank 0 of an adaptive sweep's trial; None otherwise
        # A step that runs out of memory, done again (trainer.redo): data.batch_size=auto at half the micro-batch
        # it probes for here (collective, before the checkpoint is loaded), train.invariant recomputing activations.
        record = self.run_dir.log_event if env.is_main else None
        parts = (task, strategy, model, optimizer, self.train_sums, self.amp, record)
        self.redo: Optional[redo.RedoneStep] = None
        if share is not None:
            self.redo = redo.fitted(parts, train_set, collate, share, cfg, self.run_dir.events(), env)
        elif cfg.train.invariant:
            self.redo = redo.recomputing(parts, fixed_micro(cfg.data))

    def resume(self) -> None:
        """Collective: continue from the newest checkpoint every rank verified, if there is one."""
        assert self.checkpoints is not None
        with keeps_implementation(self.optimizer):  # optim.implementation is this attempt's, not the checkpoint's
            self.restored = self.checkpoints.load_latest(self.state)
        self.resumed = True

    def start(self) -> None:
        """The attempt's start event, its records and progress lines, and rank 0's deadline stop."""
        step = self.state.pos.step
        if self.env.is_main:
            fit = self.redo.fit if self.redo is not None else None  # data.batch_size=auto: the probe's choice
            micro, accum = (fit.micro, fit.accumulation) if fit else (fixed_micro(self.cfg.data), self.grad_accum)
            self.run_dir.log_event(
                "start",
                job_id=self.env.job_id,
                restart_count=self.env.restart_count,
                launch=self.env.launch,
                step=step,
                world_size=self.env.world_size,
                nodes=self.env.num_nodes,  # what Slurm gave this attempt: an elastic job's varies (slurm.nodes MIN-MAX)
                global_batch=self.data.step_samples,
                grad_accum=accum,
                **(fit.fields() if fit else {}),
                launched=process_started(),  # this rank's process began: the launch's start-up is from here
                # where this attempt's state came from: "durable" (RUN/checkpoints) or "local" (a node-local copy)
                **({"tier": self.restored.tier} if self.restored else {}),
            )
            log.info(
                "global batch %d = %s samples x %d micro-batches x %d replicas%s",
                self.data.step_samples, micro, accum, self.strategy.data_world, fit.said() if fit else "",
            )  # fmt: skip
            if self.cfg.train.invariant:
                log_invariance(self.cfg, self.strategy, self.model, micro, accum)
        self.records = Records(self.cfg, self.run_dir, self.env, step)
        scheduler = self.state.scheduler
        self.lines = ProgressLines(
            self.cfg,
            self.env,
            self.device,
            self.data.step_samples,
            step,
            self.log_loss,
            self.train_sums,
            self.strategy.work,
            lambda: scheduler.get_last_lr()[0],
            self.records,
            self.telemetry,
        )
        self.profiler = Profiler(self.cfg, self.run_dir.path, self.env.rank, self.device)
        self.profiler.at_start(step)
        if self.env.is_main:  # rank 0's clock decides the stop before the time limit (ddp_core.cluster.deadline)
            assert self.checkpoints is not None  # build() made it
            self.stop_flag.deadline = deadline.arm(self.cfg.slurm, self.env, self.checkpoints.save_cost_s)
        on_gone = batch_node.stopping(self.stop_flag)  # the process that watches is rank 0, or, elastic, node 1's
        self.batch_watch = batch_node.watch(self.cfg.slurm, self.env, self.run_dir, on_gone)
        self.started = time.perf_counter()

    def train(self) -> Outcome:
        """The loop. Every rank runs the same steps and leaves after the same one: at max_steps, an early stop, a
        pruned trial, or a signal all ranks agreed on (``StopFlag.agree``)."""
        cfg, pos = self.cfg, self.state.pos
        assert self.checkpoints is not None and self.lines is not None and self.profiler is not None
        self.model.train()
        signum, pruned = 0, False
        last_eval: Optional[dict[str, float]] = None  # an early stop's final metrics: the evaluation that decided it
        while not (self.done() or pruned or signum):
            for group in self.strategy.work.timed(micro_batches(self.data.epoch(pos), self.grad_accum)):
                self.step(group)
                self.lines.after_step(pos.step)
                self.profiler.after_step(pos.step)
                if cfg.train.eval_every and pos.step % cfg.train.eval_every == 0 and pos.step < cfg.train.max_steps:
                    last_eval = self.evaluate()
                    pruned = cfg.trial.bound and pruning.decide(self.trial, pos.step, last_eval)
                    if pruned:
                        break
                if self.checkpoints.due(pos.step, cfg.train.max_steps):
                    self.save()
                elif self.checkpoints.local_due(pos.step, cfg.train.max_steps):
                    self.save_local()
                signum = self.stop_flag.agree()  # every step: all ranks stop after the same one
                if signum or self.done():
                    break
        if signum:
            return self.stopped(signum)
        return self.finished(pruned, last_eval)

    def step(self, group: list[Any]) -> None:
        """One optimizer step over a group of ``grad_accum`` micro-batches per replica: a global batch (under
        data.batch_size=auto one share, which ``trainer.redo`` cuts and does again if it runs out)."""
        pos = self.state.pos
        self.strategy.begin_step(pos.step)
        losses = self.micro_steps(group) if self.redo is None else self.redo(group, pos.step)
        for i, loss in enumerate(losses):
            self.log_loss.add(loss, counts=self.strategy.reports_loss and i == 0)
        self.step_optimizer()
        pos.step += 1
        pos.samples_in_epoch += self.data.step_samples  # a group is whole: micro_batches drops a short tail
        self.watchdog.beat(pos.step)

    def micro_steps(self, group: list[Any]) -> list[Any]:
        """The group's micro-batches, forward and backward; the gradients communicated on the last one."""
        amp, losses = self.amp, []
        if not self.primed:  # this attempt's first step: every attempt's steps run alike
            with amp:
                self.strategy.prime(self.task, self.model, to_device(group[0], self.device))
            self.primed = True
        for i, batch in enumerate(group):
            with amp:
                sync = i == len(group) - 1  # gradients are communicated on the last micro-batch only
                losses.append(
                    self.strategy.forward_backward(
                        self.task, self.model, to_device(batch, self.device), self.grad_accum, sync
                    )
                )
        return losses

    def done(self) -> bool:
        return self.state.pos.step >= self.cfg.train.max_steps or self.monitor.should_stop

    def evaluate(self) -> dict[str, float]:
        """Evaluate, log, and keep this step's checkpoint as the best when checkpoint.monitor improved."""
        assert self.lines is not None and self.records is not None and self.checkpoints is not None
        step = self.state.pos.step
        self.lines.finish()
        with self.watchdog.allowance(), rng.rng_untouched():  # the training's random streams go on as if
            metrics = evaluate(self.task, self.model, self.evals, self.cfg, self.strategy)  # no evaluation ran
        self.records.record("eval", metrics, step)
        if self.monitor.update(step, metrics):
            self.save(sync=step == self.cfg.train.max_steps)
            assert self.monitor.best is not None  # update() just set it
            self.checkpoints.mark_best(step, self.monitor.best)
        return metrics

    def save(self, sync: bool = False) -> None:
        """Collective: checkpoint this step (once). ``sync``: complete when this returns (a signal's, the last)."""
        assert self.lines is not None and self.records is not None and self.checkpoints is not None
        self.lines.finish()  # its loss is checked (train.stop_on_nan) and logged before the checkpoint that follows
        if self.checkpoints.saved_step == self.state.pos.step:
            return
        self.records.sync()
        with self.watchdog.allowance():  # a save of a large model may take longer than a step may stall
            figures = self.checkpoints.save(self.state, sync)
        if figures:
            self.records.record("checkpoint", figures, self.state.pos.step)

    def save_local(self) -> None:
        """Collective: this step's node-local copy (``checkpoint.local_every_steps``), written in the background."""
        assert self.checkpoints is not None and self.lines is not None
        self.lines.finish()  # this step's progress line is written before a copy an attempt may resume from
        with self.watchdog.allowance():  # it waits for the previous copy if that is still being written
            self.checkpoints.save_local(self.state)

    def stopped(self, signum: int) -> Outcome:
        """Collective: the ranks agreed on a signal after this step: checkpoint it if that fits, and stop."""
        assert self.checkpoints is not None and self.lines is not None
        lead = self.cfg.checkpoint.sigterm_budget_s if signum == signal.SIGTERM else self.cfg.slurm.signal_lead_s
        if self.checkpoints.settle(lead, self.stop_flag.received_at) and self.checkpoints.fits_before(signum):
            self.save(sync=True)
        self.interrupted = True
        why = " (the deadline stop)" if self.stop_flag.by_deadline else ""
        log.info("stopping at step %d on %s%s", self.state.pos.step, signal.Signals(signum).name, why)
        self.lines.finish()
        self.checkpoints.close()  # an async save completes before the requeue (and the process group)
        self.stop_flag.settle()
        return Outcome(step=self.state.pos.step, final=None, signum=signum)

    def finished(self, pruned: bool, last_eval: Optional[dict[str, float]]) -> Outcome:
        """Collective: the run is complete (or pruned, or stopped early): the final evaluation and checkpoint."""
        cfg, step = self.cfg, self.state.pos.step
        self.stop_flag.settle()  # a signal in the last step is moot: the run is complete (or pruned)
        final: Optional[dict[str, float]] = None  # a pruned trial has none: its study already has its evals
        if self.monitor.should_stop and last_eval is not None:
            final = last_eval
            log.info(
                "early stop at step %d: %s has not improved on %.6g (step %d) for %d evaluations",
                step,
                cfg.checkpoint.monitor,
                self.monitor.best,
                self.monitor.best_step,
                self.monitor.stale,
            )
        elif not pruned:
            final = self.evaluate()
        self.save(sync=True)
        assert self.checkpoints is not None
        self.checkpoints.require_saved(step)  # not on a full filesystem: the attempt is requeued
        self.checkpoints.close()  # an async save completes before the run is called complete
        self.checkpoints.discard_local()  # the final checkpoint is durable: the node-local copies are done with
        scores = " ".join(f"{k} {v:.4f}" for k, v in (final or {}).items())
        elapsed = time.perf_counter() - self.started
        log.info("%s at step %d in %.1f s: %s", "pruned" if pruned else "finished", step, elapsed, scores)
        peak = groups.peak_memory_gb(self.device)
        if peak is not None:
            log.info("peak GPU memory on %s: %.2f GB allocated by tensors", self.device, peak)
        log.info("peak host memory of this rank: %s", memory.host_peak())
        # Every rank logs its own digest: replicas that drifted apart show up as different lines.
        log.info("final weights sha256 %s", weights_digest(self.strategy.full_model_state(self.model)))
        return Outcome(step=step, final=final, pruned=pruned, early_stopped=self.monitor.should_stop)

    def close(self, error: Optional[BaseException]) -> None:
        """This rank's teardown, whatever happened: no collective (a failed rank's peers may be gone). After a
        success or a signal's stop the writers are closed already (``finished``, ``stopped``). After a user error
        or an out-of-memory no attempt of this job will run again: this node's local copies go."""
        failed = error is not None
        if self.batch_watch is not None:
            self.batch_watch.stop()
        try:
            if self.checkpoints is not None:
                self.checkpoints.close(wait=False)  # rank 0's own async full save still completes
        except Exception:
            if not failed:
                raise
            log.exception("closing the checkpoint writers after the failure")  # the failure itself is logged next
        finally:
            if self.checkpoints and isinstance(error, Exception) and redo.ends_the_job(error):
                self.checkpoints.discard_local(collective=False)
            if self.profiler is not None:
                self.profiler.close(self.at_step())
            if self.lines is not None:
                self.lines.close()
            if self.records is not None:
                self.records.finish("failed" if failed else "stopped" if self.interrupted else "finished")
