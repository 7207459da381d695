"""Full checkpoints from rank 0, synchronous or in the background (``checkpoint.async_save``).

``FullWriter`` owns rank 0's saves of one run. A synchronous save is ``checkpoint.save`` in the training thread;
the prune of old checkpoints after it runs in a thread of its own, waited for by the next save, ``wait`` and ``close``.
An async save copies the state to host memory (``staging``; page-locked on CUDA); a background thread then
writes, fsyncs, writes the manifest last and prunes, as a synchronous save does, so a kill at any moment
still leaves either a complete checkpoint or one ``find_latest`` skips. Given the optimizer, the copy of its
parameters and state runs alongside the next forward and backward, which do not change them, and the optimizer's
next step waits for it (a step pre-hook); training blocks only for the rest (buffers, plain values) and whatever
of the copy the forward and backward did not hide.

At most one save is in flight: the next save, ``wait`` and ``close`` wait for it, and a background failure is
logged when it happens and raised (``CheckpointWriteError``) in the training thread at that wait. A save called
with ``sync=True`` (the one a signal triggers, the last one) waits for the one in flight, then writes in the
training thread: it is complete when it returns, before the job requeues or exits.

The host copy is kept from save to save and reused while the state's storages keep their sizes: allocating (and
page-locking) a multi-GB buffer costs more than the copy itself. Async saves thus hold one more copy of the model
and optimizer state in host memory for the whole run.

The overlap assumes what torch's optimizers and the strategies here do: parameters and optimizer state change only
in the optimizer's step. A model that writes its own parameters in its forward must not use ``async_save``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from torch import nn

from ddp_core.checkpoint import store as checkpoint
from ddp_core.checkpoint.staging import Copying, Staging, StorageKey, storage_key
from ddp_core.checkpoint.storage import Location
from ddp_core.errors import DdpJobError

log = logging.getLogger(__name__)


class CheckpointWriteError(DdpJobError):
    """A checkpoint written in the background failed (a full disk, a lost file system)."""


class FullWriter:
    """Rank 0's writer of one run's full checkpoints (``checkpoint.save``), synchronous or in the background."""

    def __init__(
        self,
        directory: Location,
        keep_last: int,
        async_save: bool,
        writer_rank: int = 0,
        optimizer: Optional[torch.optim.Optimizer] = None,
        before_write: Optional[Callable[[int, dict[str, Any]], dict[str, Any]]] = None,
        after_write: Optional[Callable[[int, Optional[checkpoint.CheckpointInfo]], None]] = None,
        level: int = logging.INFO,
        private: bool = False,
    ) -> None:
        self.directory, self.keep_last, self.writer_rank = directory, keep_last, writer_rank
        self.level = level  # of the lines each save logs (the node-local tier's, at every few steps, are DEBUG)
        self.private = private  # a folder of this user's alone (the node-local tier's): files 0600
        # Called in the writing thread: before each write with (step, the state), returning what is written, and
        # after it with (step, the checkpoint), or (step, None) after a failed one. The node-local tier gathers the
        # ranks' own parts there, and sends its copy to a peer node (``local``, ``local_replica``): work that
        # pairs with the other ranks' writers, in order, off the training thread.
        self._before_write, self._after_write = before_write, after_write
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if async_save else None
        self._staging = Staging()
        self._optimizer = optimizer if async_save else None
        self._copying: Optional[Copying] = None  # an async save's copy of the optimizer's tensors, until its step
        self._hook = self._optimizer.register_step_pre_hook(self._fence) if self._optimizer is not None else None
        self.fence_s = 0.0  # what the last optimizer step waited for the copy: training blocked, after the save
        self._pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-prune")
        self._pruning: Optional[Future[None]] = None  # the prune after a synchronous save
        self._pending: Optional[Future[checkpoint.CheckpointInfo]] = None
        self._pending_step = -1
        # Seconds the last completed save took from its start to its manifest: what a synchronous save costs
        # (the one a signal triggers), whether or not it ran in the background. None before the first one.
        self.last_write_s: Optional[float] = None
        if checkpoint.CHECKSUM == "sha256":
            log.warning(
                "the Python package xxhash is not installed: full checkpoints are checksummed with sha256, "
                "which adds ~1 s per GB to each save (pip install xxhash)"
            )

    @property
    def async_save(self) -> bool:
        return self._background is not None

    def save(self, step: int, state: dict[str, Any], sync: bool = False) -> float:
        """Write ``state`` as the checkpoint of ``step``; in the background for an async writer unless ``sync``.
        Returns the seconds the caller was blocked (for a background save: waiting for the previous one, copying
        what the optimizer does not hold; the optimizer's next step waits for the rest: ``fence_s``)."""
        started = time.perf_counter()
        self.wait()  # at most one save in flight: bounded memory, and manifests appear in step order
        if self._background is None or sync:
            began = time.perf_counter()
            if self._before_write is not None:
                state = self._before_write(step, state)
            info = checkpoint.save(
                self.directory,
                step,
                state,
                self.keep_last,
                self.writer_rank,
                prune_old=False,
                level=self.level,
                private=self.private,
            )
            self.last_write_s = time.perf_counter() - began
            if self._after_write is not None:
                self._after_write(step, info)
            # Deleting the oldest checkpoint is off the training thread: unlinking a multi-GB file (and, on a file
            # system mounted with discard, trimming its blocks at the next journal commit) cost 0.3 to 1.5 s here,
            # a third of the save itself. The checkpoint just written is complete either way.
            self._pruning = self._pruner.submit(checkpoint.prune, self.directory, self.keep_last)
            return time.perf_counter() - started
        began = time.perf_counter()
        snapshot, self._copying = self._staging.start(state, later=self._later())
        blocked = time.perf_counter() - started
        self.fence_s = 0.0
        self._pending = self._background.submit(self._write, step, snapshot, self._copying, began)
        self._pending_step = step
        log.log(
            self.level,
            "checkpoint step %d: training blocked %.3f s for the copy, writing in the background",
            step,
            blocked,
        )
        return blocked

    def _later(self) -> set[StorageKey]:
        """The storages copied while training goes on: the optimizer's parameters and state, which only its step
        changes (a forward changes buffers, a backward gradients, and neither is among them). Plain tensors only."""
        if self._optimizer is None:
            return set()
        tensors = [p for group in self._optimizer.param_groups for p in group["params"]]
        tensors += [v for state in self._optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        return {storage_key(t) for t in tensors if type(t) in (torch.Tensor, nn.Parameter)}

    def _fence(self, *_: Any) -> None:
        """The optimizer's step pre-hook: the copy of what the step changes is complete (or, on a GPU, queued
        ahead of the step)."""
        if self._copying is not None:
            started = time.perf_counter()
            self._copying.fence()
            self._copying = None
            self.fence_s = time.perf_counter() - started

    def _write(self, step: int, snapshot: dict[str, Any], copying: Copying, began: float) -> checkpoint.CheckpointInfo:
        info: Optional[checkpoint.CheckpointInfo] = None
        try:
            copying.wait()
            if self._before_write is not None:
                snapshot = self._before_write(step, snapshot)
            info = checkpoint.save(
                self.directory, step, snapshot, self.keep_last, self.writer_rank, level=self.level, private=self.private
            )
        except BaseException as err:
            # Logged now, with its traceback: the training thread learns of it only at its next wait. A quiet writer's
            # (the node-local tier's, which falls back to the durable tier): one line.
            if self.level >= logging.INFO:
                log.exception("the checkpoint of step %d failed in the background", step)
            else:
                log.warning("the copy of step %d in %s failed: %s: %s", step, self.directory, type(err).__name__, err)
            raise
        finally:
            if self._after_write is not None:
                self._after_write(step, info)
        self.last_write_s = time.perf_counter() - began
        return info

    def wait(self) -> float:
        """Block until the save in flight, if any, is complete (manifest written), and the prune after the last
        synchronous save too. Returns the seconds waited. Raises ``CheckpointWriteError`` if the save failed."""
        started = time.perf_counter()
        self._wait_pruned()
        if self._pending is None:
            return time.perf_counter() - started
        pending, self._pending, self._copying = self._pending, None, None  # the write waited for the copy
        try:
            pending.result()
        except Exception as err:
            raise CheckpointWriteError(
                f"the checkpoint of step {self._pending_step} failed in the background: {type(err).__name__}: {err}",
                f"check free space and permissions in {self.directory}; resuming starts from the newest complete "
                "checkpoint there",
            ) from err
        return time.perf_counter() - started

    def settle(self, within_s: float) -> bool:
        """Wait at most ``within_s`` for the save in flight; whether none is left (raising its failure, as ``wait``).
        One still in flight is left to ``close(wait=False)``: its manifest is never written, so the newest complete
        checkpoint is the one before it."""
        if not checkpoint.done_within(self._pending, within_s):
            return False
        self.wait()
        return True

    def _wait_pruned(self) -> None:
        """Wait for the prune after the last synchronous save. A failed one only leaves an old checkpoint behind
        (the next prune retries it): logged, not raised."""
        if self._pruning is None:
            return
        pruning, self._pruning = self._pruning, None
        try:
            pruning.result()
        except Exception as err:
            log.warning("pruning old checkpoints in %s failed: %s: %s", self.directory, type(err).__name__, err)

    def close(self, wait: bool = True) -> None:
        """Wait for the save in flight (raising its failure) and stop the background thread. ``wait=False``: leave a
        save that did not settle (a stalled upload at a stop): the process ends without it."""
        try:
            if wait:
                self.wait()
        finally:
            if self._hook is not None:
                self._hook.remove()
            self._staging.close()
            self._pruner.shutdown(wait=wait)
            if self._background is not None:
                self._background.shutdown(wait=wait, cancel_futures=not wait)
