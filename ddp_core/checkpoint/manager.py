"""The checkpoint manager: one object per attempt owns the run's checkpoints.

It decides when a save is due (``checkpoint.every_steps``), picks the writer (full from rank 0 or sharded from every
rank, each synchronous or async, by the strategy's ``checkpoint_kind`` and ``checkpoint.async_save``), loads the
newest checkpoint every rank verified, keeps the best one (``checkpoint.monitor``), and knows what a synchronous
save costs, for the SIGTERM budget (``checkpoint.sigterm_budget_s``) and the deadline stop (``save_cost_s``).
Pruning (``checkpoint.keep_last``) happens in the writers after each save. The trainer calls it in one line per use;
what it saves is the ``TrainState``'s ``state_dict`` plus the model and optimizer as the strategy lays them out.

With ``checkpoint.local_every_steps`` it also keeps the node-local tier (``local``): copies of the same state in
node memory between durable checkpoints; at start the newer of the newest local copy every rank can get
(``local_restore``) and the newest durable checkpoint is loaded (``restored`` says which).
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from torch import nn

from ddp_core.checkpoint import full as full_checkpoint
from ddp_core.checkpoint import loadable, local_restore, store
from ddp_core.checkpoint.local import LocalTier, fill_shards, local_shards, open_tier
from ddp_core.checkpoint.local_replica import pack, unpack
from ddp_core.checkpoint.train_state import TrainState
from ddp_core.cluster.env import DistEnv
from ddp_core.config import CheckpointConfig
from ddp_core.distributed import collectives
from ddp_core.run import diskfull
from ddp_core.run.rundir import RunDir

if TYPE_CHECKING:
    import torch

    from ddp_core.checkpoint.sharded import ShardedWriter

log = logging.getLogger(__name__)


class Layout(Protocol):
    """How a strategy lays out a model's and an optimizer's state (``ddp_core.strategies.Strategy``)."""

    @property
    def checkpoint_kind(self) -> str: ...  # store.FULL or store.SHARDED

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]: ...

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None: ...

    def load_optimizer_state(self, model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None: ...

    def model_keys(self, model: nn.Module) -> list[str]: ...

    def sharded_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]: ...

    def load_sharded_state(self, model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None: ...


def load_checkpoint(info: store.CheckpointInfo, layout: Layout, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Collective: restore model and optimizer from either kind of checkpoint, under any strategy. Returns the
    rest of it (the train state's entries)."""
    if info.kind == store.SHARDED:
        from ddp_core.checkpoint import sharded  # DCP: imported by the runs that use it (a second of imports)

        state, rest = sharded.load(info, layout.sharded_state(model, optimizer))
        layout.load_sharded_state(model, optimizer, state)
        return rest
    return load_full(store.load(info), layout, model, optimizer)


def load_full(state: dict[str, Any], layout: Layout, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Restore model and optimizer from a full checkpoint's state; returns it (the train state reads the rest)."""
    layout.load_model_state(model, state["model"])
    layout.load_optimizer_state(model, optimizer, state["optimizer"])
    return state


@dataclass(frozen=True)
class Restored:
    """What an attempt started from: ``tier`` "durable" (a checkpoint in the run directory) or "local" (a node-local
    copy), and its step."""

    tier: str
    step: int


class CheckpointManager:
    """A run's checkpoints for one attempt, on every rank. ``save`` and ``load_latest`` are collective."""

    def __init__(
        self, cfg: CheckpointConfig, run_dir: RunDir, env: DistEnv, layout: Layout, model: nn.Module, optimizer: Any
    ) -> None:
        self.cfg, self.run_dir, self.env = cfg, run_dir, env
        self.layout, self.model, self.optimizer = layout, model, optimizer
        # RUN/checkpoints, or this run's folder under checkpoint.dir: a local path or an object storage URL.
        self.location = run_dir.checkpoint_location(cfg.dir)
        self.sharded: Optional[ShardedWriter] = None
        self.full: Optional[full_checkpoint.FullWriter] = None
        if layout.checkpoint_kind == store.SHARDED:
            from ddp_core.checkpoint.sharded import ShardedWriter

            self.sharded = ShardedWriter(self.location, cfg.keep_last, cfg.async_save, env.rank, env.world_size)
        elif env.is_main:
            self.full = full_checkpoint.FullWriter(self.location, cfg.keep_last, cfg.async_save, optimizer=optimizer)
        self.last_save_s = 0.0  # what training blocked for in the last save
        self.saved_step = -1
        self.longest_save_s = 0.0  # the longest any save of this attempt blocked training
        self.stalled = False  # the save in flight did not complete in the time a stop had for it (settle)
        self.recorded_s: Optional[float] = None  # what earlier attempts' saves cost (metrics.jsonl), read once
        self.checked = False  # the first save's state was checked for weights_only loading (``loadable``)
        self.failed_saves = 0  # saves in a row a full or failing filesystem refused (``diskfull``)
        self.local: Optional[LocalTier] = None
        if cfg.local_every_steps and env.job_id is None:
            log.warning("checkpoint.local_every_steps: this process has no job id to key node-local copies by: off")
        elif cfg.local_every_steps:
            self.local = open_tier(cfg, env, run_dir, layout.checkpoint_kind, optimizer)  # None: refused, off

    def load_latest(self, state: TrainState) -> Optional[Restored]:
        """Collective: load the newest checkpoint every rank verified, or a newer node-local copy every rank can get,
        into the model, the optimizer and ``state``; None (and nothing loaded) when there is neither."""
        latest = store.find_latest_agreed(self.location)
        durable = -1 if latest is None else latest.step
        found = local_restore.restore(self.local, durable) if self.local is not None else None
        if found is not None:
            step, copy, where = found
            state.load_state_dict(self.load_local(copy) | {"config": state.config}, self.env)
            log.info(
                "resumed from the node-local copy of step %d (epoch %d) from %s, newer than the newest durable "
                "checkpoint (%s): tier local",
                state.pos.step,
                state.pos.epoch,
                where,
                f"step {durable}" if latest is not None else "none",
            )
            assert step == state.pos.step, "a copy holds its own step"
            return Restored("local", step)
        if latest is None:
            return None
        state.load_state_dict(load_checkpoint(latest, self.layout, self.model, self.optimizer), self.env)
        log.info("resumed from %s (step %d, epoch %d): tier durable", latest.name, state.pos.step, state.pos.epoch)
        return Restored("durable", latest.step)

    def load_local(self, copy: dict[str, Any]) -> dict[str, Any]:
        """Restore model and optimizer from a node-local copy; returns the train state's entries: rank 0's shared
        ones and this rank's own (the other ranks' own parts are not needed, and a sharded copy holds none)."""
        if self.layout.checkpoint_kind == store.SHARDED:
            template = self.layout.sharded_state(self.model, self.optimizer)
            self.layout.load_sharded_state(self.model, self.optimizer, fill_shards(template, copy["shards"]))
        else:
            load_full(copy, self.layout, self.model, self.optimizer)
        parts = copy["ranks"]
        shared = unpack(parts[0])["shared"]
        owns = [unpack(parts[rank])["own"] if rank == self.env.rank else None for rank in range(shared["world_size"])]
        return shared | {"rng": [o and o["rng"] for o in owns], "per_rank": [o and o["per_rank"] for o in owns]}

    def local_due(self, step: int, max_steps: int) -> bool:
        """A node-local copy after ``step`` (``checkpoint.local_every_steps``; the trainer asks when no durable save
        is due: that one is as new)."""
        return self.local is not None and self.local.due(step, max_steps)

    def save_local(self, state: TrainState) -> float:
        """Collective: the node-local copy of ``state``'s step, written in the background. Returns the seconds
        training blocked (staging the copy; waiting for the previous one if it is still being written)."""
        assert self.local is not None
        started = time.perf_counter()
        shared, own = state.parts(self.env)
        # Packed now (small: the ranks' parts travel in the background), so the copy's staging walks no RNG state.
        # Only rank 0's shared entries are loaded (as from a durable checkpoint); the config is the attempt's own.
        shared.pop("config")
        packed = pack({"shared": shared, "own": own} if self.env.is_main else {"own": own})
        whole: dict[str, Any] = {}
        if self.layout.checkpoint_kind == store.SHARDED:
            whole = {"shards": local_shards(self.layout.sharded_state(self.model, self.optimizer))}
        elif self.local.writer is not None:
            whole = {"model": self.layout.model_state(self.model), "optimizer": self.optimizer.state_dict()}
        self.local.save(state.pos.step, whole, packed)
        return time.perf_counter() - started

    def discard_local(self, collective: bool = True) -> None:
        """The run is over (completed, or failed so that no attempt of this job can continue it): remove this node's
        copies. ``collective``: after every rank's writers are closed, by each node's first rank; else (a failing
        rank) by this rank at once."""
        if self.local is None:
            return
        if collective:
            collectives.barrier()  # no rank of the node is still writing into it
        if self.local.leader or not collective:
            self.local.discard()

    def due(self, step: int, max_steps: int) -> bool:
        """A periodic save after ``step`` (the last step's save is the end's, not a periodic one)."""
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0 and step < max_steps

    def save(self, state: TrainState, sync: bool = False) -> Optional[dict[str, float]]:
        """Collective: checkpoint ``state``'s step, unless it is saved already. ``sync``: a full checkpoint is
        complete when this returns (a signal's, the last one). Returns the save's figures for the metrics log; None
        when it was saved already, or could not be (a full or failing filesystem: ``failed``)."""
        step = state.pos.step
        if self.saved_step == step:
            return None
        started = time.perf_counter()
        rest = state.state_dict(self.env)
        before = _disk_failure(self._wait_in_flight)  # a background save's failure surfaces here
        failed = _disk_failure(lambda: self._write(step, rest, sync))
        if not self._agreed(step, failed or (None if sync or not self.cfg.async_save else before)):
            return None
        self.last_save_s, self.saved_step = time.perf_counter() - started, step
        self.longest_save_s = max(self.longest_save_s, self.last_save_s)
        if self.env.is_main:
            log.info("training blocked %.3f s for the checkpoint of step %d", self.last_save_s, step)
        # write_s: what the last completed save cost from start to manifest, i.e. what a signal's synchronous save
        # costs (save_s is far less for a background save).
        written = {"write_s": round(self.full.last_write_s, 4)} if self.full and self.full.last_write_s else {}
        return {"save_s": round(self.last_save_s, 4)} | written

    def _wait_in_flight(self) -> None:
        if self.full is not None:
            self.full.wait()
        if self.sharded is not None:
            self.sharded.wait()

    def _write(self, step: int, rest: dict[str, Any], sync: bool) -> None:
        """This rank's part of the save; the first of the attempt checks that it would load (``loadable``)."""
        if self.sharded is not None:
            # The whole model's parameter names, in order: rank 0 may hold only part of them (a pipeline stage).
            rest["model_keys"] = self.layout.model_keys(self.model)
            shards = self.layout.sharded_state(self.model, self.optimizer)
            if not self.checked:
                loadable.check_first_save(shards | rest if self.env.is_main else None)
                self.checked = True
            self.sharded.save(step, shards, rest if self.env.is_main else None)
            return
        whole: Optional[dict[str, Any]] = None
        if self.env.is_main:
            whole = {"model": self.layout.model_state(self.model), "optimizer": self.optimizer.state_dict()} | rest
        if not self.checked:
            loadable.check_first_save(whole)
            self.checked = True
        if whole is not None:
            assert self.full is not None, "rank 0 writes full checkpoints through its FullWriter"
            self.full.save(step, whole, sync=sync)

    def _agreed(self, step: int, failed: Optional[OSError]) -> bool:
        """Collective (and the barrier after a save: nobody runs ahead, or exits, before the checkpoint is durable, or
        copied): whether every rank's part of the save of ``step`` succeeded. A full or failing filesystem
        (``diskfull``) is a warning and an event, and training goes on; ``MAX_FAILED_SAVES`` in a row raise
        ``StorageFailing`` on every rank (the attempt is requeued)."""
        codes = [int(c[0]) for c in collectives.all_gather_floats([float(failed.errno or 1) if failed else 0.0])]
        if not any(codes):
            if self.failed_saves and self.env.is_main:
                self.run_dir.log_event("save_recovered", job_id=self.env.job_id, step=step)
            self.failed_saves = 0
            return True
        self.failed_saves += 1
        error = failed or OSError(next(c for c in codes if c), "")
        why = diskfull.describe(error, self._on_disk())
        if self.env.is_main:
            log.warning(
                "the checkpoint of step %d was not saved: %s; training goes on and the next save tries again (%d of "
                "%d failed saves in a row)",
                step,
                why,
                self.failed_saves,
                diskfull.MAX_FAILED_SAVES,
            )
            self.run_dir.log_event("save_failed", job_id=self.env.job_id, step=step, error=why, count=self.failed_saves)
        if self.failed_saves >= diskfull.MAX_FAILED_SAVES:
            raise diskfull.StorageFailing(
                f"{self.failed_saves} checkpoints in a row could not be saved, the last at step {step}: {why}"
            )
        return False

    def save_cost_s(self) -> float:
        """What a synchronous save costs, as this rank measured it, no collective: the longest save of this attempt,
        or the last one a writer completed in the background (rank 0), whichever is longer; before any, what
        earlier attempts recorded (``metrics.jsonl``'s checkpoint records); 0 if none did."""
        writer = self.full or self.sharded
        cost = max(self.longest_save_s, (writer.last_write_s if writer is not None else None) or 0.0)
        if cost > 0:
            return cost
        if self.recorded_s is None:
            self.recorded_s = recorded_save_cost(self.run_dir)
        return self.recorded_s

    def fits_before(self, signum: int) -> bool:
        """Collective: whether a synchronous save fits before Slurm's SIGKILL: always for the warning signal; for
        SIGTERM, when rank 0's last complete save took at most ``checkpoint.sigterm_budget_s`` (one answer on
        every rank: the save is collective)."""
        if signum != signal.SIGTERM:
            return True
        cost = max(self.last_save_s, self.full.last_write_s or 0.0) if self.full is not None else self.last_save_s
        cost = collectives.all_gather_floats([cost])[0][0]
        if cost > self.cfg.sigterm_budget_s:
            log.warning("SIGTERM: the last save took %.1f s, over checkpoint.sigterm_budget_s", cost)
        return cost <= self.cfg.sigterm_budget_s

    def settle(self, lead_s: float, signalled_at: float) -> bool:
        """Collective, at a stop: wait for the background save in flight while the stop's ``lead_s`` (seconds from
        the first rank's signal, ``signalled_at``, to Slurm's kill) lasts, less ``STOP_MARGIN_S`` for the exit;
        whether it completed on every rank (one answer everywhere). An upload that stalled (object storage that
        stopped answering) must not hold the stop past the kill: it is left (``close``), unfinished, and the run
        resumes from the checkpoint before it, which is complete."""
        if not self.cfg.async_save:  # the same on every rank: no collective without a save in flight
            return True
        first = min((at[0] for at in collectives.all_gather_floats([signalled_at]) if at[0] > 0), default=time.time())
        within = lead_s - (time.time() - first) - STOP_MARGIN_S
        writer = self.full or self.sharded
        done = writer is None or writer.settle(within)
        self.stalled = min(ranks[0] for ranks in collectives.all_gather_floats([float(done)])) < 1.0
        if self.stalled and self.env.is_main:
            log.warning(
                "the checkpoint in flight did not complete within %.0f s of the signal (storage stalled?): it is "
                "left unfinished, and the run resumes from the checkpoint before it",
                lead_s - STOP_MARGIN_S,
            )
        return not self.stalled

    def mark_best(self, step: int, value: float) -> None:
        """Rank 0: the checkpoint of ``step`` is the best by ``checkpoint.monitor`` (if it was saved: not on a full
        filesystem, where the mark is a warning too)."""
        if self.env.is_main and self.saved_step == step:
            if failed := _disk_failure(lambda: store.mark_best(self.location, step, str(self.cfg.monitor), value)):
                log.warning(
                    "the best checkpoint (step %d) is not marked: %s", step, diskfull.describe(failed, self._on_disk())
                )

    def _on_disk(self) -> Path:
        """The folder whose filesystem a failed save names: the checkpoints', or the run directory's."""
        return self.location if isinstance(self.location, Path) else self.run_dir.path

    def require_saved(self, step: int) -> None:
        """The run is complete only with its last checkpoint: ``StorageFailing`` (requeued) if it was not saved."""
        if self.saved_step != step:
            raise diskfull.StorageFailing(f"the final checkpoint (step {step}) could not be saved (see the warning)")

    def close(self, wait: bool = True) -> None:
        """Stop the writers (again: a no-op). ``wait``: complete an async save in flight first (before the requeue,
        and before the process group goes away). Without it (a failed attempt), a sharded save in flight, which
        would need the other ranks, is left; a full one, rank 0's own thread, still completes, unless it stalled."""
        full, sharded, self.full, self.sharded = self.full, self.sharded, None, None
        try:
            if full is not None:
                full.close(wait=not self.stalled)
            if sharded is not None:
                sharded.close(wait and not self.stalled)
        finally:
            if self.local is not None:
                self.local.close(wait)


def _disk_failure(write: Callable[[], None]) -> Optional[OSError]:
    """Run ``write``; the ENOSPC, EDQUOT or EIO behind its failure (``diskfull``), which is not raised; anything else
    is."""
    try:
        write()
    except Exception as err:
        if (found := diskfull.disk_error(err)) is None:
            raise
        return found
    return None


# What a stop keeps of its lead time for what follows the save in flight: the requeue and the exit.
STOP_MARGIN_S = 5.0

# The checkpoint records a save's cost is read from: the most recent few (an old one may predate a larger model).
RECENT_SAVES = 3


def recorded_save_cost(run_dir: RunDir) -> float:
    """The longest of the run's most recent saves in ``metrics.jsonl`` (``save_s``, or ``write_s`` for one in the
    background); 0 if none is recorded. Only the checkpoint records are parsed."""
    try:
        lines = [line for line in run_dir.metrics_file.read_text().splitlines() if '"split": "checkpoint"' in line]
    except OSError:
        return 0.0
    costs = []
    for line in lines[-RECENT_SAVES:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        costs += [float(v) for k, v in record.items() if k in ("save_s", "write_s") and isinstance(v, (int, float))]
    return max(costs, default=0.0)
