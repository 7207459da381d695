"""Full checkpoints from rank 0, synchronous or in the background (``checkpoint.async_save``).

``FullWriter`` owns rank 0's saves of one run. A synchronous save is ``checkpoint.save`` in the training thread;
the prune of old checkpoints after it runs in a thread of its own, waited for by the next save, ``wait`` and ``close``.
An async save blocks training only while the state is copied to host memory (``Staging``; page-locked on CUDA,
so the copy runs at full speed and the GPU copies of later steps cannot change it); a background thread then
writes, fsyncs, writes the manifest last and prunes, as a synchronous save does, so a kill at any moment
still leaves either a complete checkpoint or one ``find_latest`` skips.

At most one save is in flight: the next save, ``wait`` and ``close`` wait for it, and a background failure is
logged when it happens and raised (``CheckpointWriteError``) in the training thread at that wait. A save called
with ``sync=True`` (the one a signal triggers, the last one) waits for the one in flight, then writes in the
training thread: it is complete when it returns, before the job requeues or exits.

The host copy is kept from save to save and reused while the state's storages keep their sizes: allocating (and
page-locking) a multi-GB buffer costs more than the copy itself. Async saves thus hold one more copy of the model
and optimizer state in host memory for the whole run.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn

from ddp_core import checkpoint
from ddp_core.errors import DdpJobError

log = logging.getLogger(__name__)


class CheckpointWriteError(DdpJobError):
    """A checkpoint written in the background failed (a full disk, a lost file system)."""


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of a state: in dicts, lists and tuples, depth first, in order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Staging:
    """Host copies of states' tensors, in buffers reused from one copy to the next."""

    def __init__(self) -> None:
        self._buffers: list[tuple[torch.UntypedStorage, bool]] = []  # (buffer, pinned), by first use in the state
        self._copiers: Optional[ThreadPoolExecutor] = None
        self._copier_threads = 0

    def copy(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` that shares nothing mutable with it: every tensor on the CPU in a staging buffer,
        everything else deep-copied. Tensors that share a storage share one buffer, with their own offsets and
        strides, so ``torch.save`` writes the copy exactly as it would write ``state`` (on the CPU, byte for
        byte)."""
        staged: dict[tuple[torch.device, int], torch.UntypedStorage] = {}  # a source storage -> its buffer
        memo: dict[int, Any] = {}  # for deepcopy: each tensor (by id) -> its copy
        cuda: set[torch.device] = set()
        host: list[tuple[np.ndarray, np.ndarray]] = []  # (to, from): the copies from host memory
        for tensor in _tensors(state):
            if id(tensor) in memo:
                continue
            if tensor.layout != torch.strided:  # sparse and the like have no one storage: a plain copy
                memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
                continue
            source = tensor.untyped_storage()
            key = (source.device, source.data_ptr())
            buffer = staged.get(key) if key[1] else None  # storages of no bytes all have address 0: never shared
            if buffer is None:
                buffer = self._buffer(len(staged), source.nbytes(), pin=source.device.type == "cuda")
                if source.device.type == "cpu":
                    host.append((_bytes(buffer).numpy(), _bytes(source).numpy()))
                elif source.device.type == "cuda":
                    _bytes(buffer).copy_(_bytes(source), non_blocking=True)  # into page-locked memory: async
                    cuda.add(source.device)
                else:
                    _bytes(buffer).copy_(_bytes(source))
                staged[key] = buffer
            view = torch.empty(0, dtype=tensor.dtype).set_(buffer, tensor.storage_offset(), tensor.size(),
                                                           tensor.stride())  # fmt: skip
            view.requires_grad_(tensor.requires_grad)
            memo[id(tensor)] = nn.Parameter(view, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else view
        self._copy_host(host)
        for device in cuda:
            torch.cuda.synchronize(device)  # the copies are complete before the caller goes on training
        # Plain values (positions, RNG states, the config) are copied too: the caller may change them after.
        return copy.deepcopy(state, memo)

    def _copy_host(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """numpy's copy is a plain memcpy, 1.7x the bandwidth of torch's CPU copy kernel here (1.2 GB: 0.19 vs
        0.33 s), but one thread: storages go to a pool of threads (numpy releases the GIL). Each is copied whole:
        memcpy streams a large copy past the cache (64 MB at once: 4.1 GB/s, in 32 MB slices: 2.8 GB/s here).

        The pool has a thread per CPU this process may run on (its affinity: Slurm's share of the node), not per
        thread torch computes with: training is blocked for the copy, so those CPUs are otherwise idle (1.2 GB:
        0.145 s on 1 thread, 0.109 s on 2 here). Memory bandwidth is spent well before 8."""
        threads = min(8, max(torch.get_num_threads(), len(os.sched_getaffinity(0))))
        if threads > 1 and len(pieces) > 1:
            if self._copier_threads != threads:
                self.close()
                self._copiers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-copy")
                self._copier_threads = threads
            assert self._copiers is not None
            for _ in self._copiers.map(lambda piece: np.copyto(*piece), pieces):
                pass
        else:
            for to, source in pieces:
                np.copyto(to, source)

    def close(self) -> None:
        if self._copiers is not None:
            self._copiers.shutdown()
            self._copiers, self._copier_threads = None, 0

    def _buffer(self, index: int, nbytes: int, pin: bool) -> torch.UntypedStorage:
        if index < len(self._buffers):
            old, pinned = self._buffers[index]
            if old.nbytes() == nbytes and pinned == pin:
                return old
        fresh = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
        if index < len(self._buffers):
            self._buffers[index] = (fresh, pin)
        else:
            self._buffers.append((fresh, pin))
        return fresh


class FullWriter:
    """Rank 0's writer of one run's full checkpoints (``checkpoint.save``), synchronous or in the background."""

    def __init__(self, directory: Path, keep_last: int, async_save: bool, writer_rank: int = 0) -> None:
        self.directory, self.keep_last, self.writer_rank = directory, keep_last, writer_rank
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if async_save else None
        self._staging = Staging()
        self._pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-prune")
        self._pruning: Optional[Future[None]] = None  # the prune after a synchronous save
        self._pending: Optional[Future[checkpoint.CheckpointInfo]] = None
        self._pending_step = -1
        # Seconds the last completed save took from its start to its manifest: what a synchronous save costs
        # (the one a signal triggers), whether or not it ran in the background. None before the first one.
        self.last_write_s: Optional[float] = None
        if checkpoint.CHECKSUM == "sha256":
            log.warning("the Python package xxhash is not installed: full checkpoints are checksummed with sha256, "
                        "which adds ~1 s per GB to each save (pip install xxhash)")  # fmt: skip

    @property
    def async_save(self) -> bool:
        return self._background is not None

    def save(self, step: int, state: dict[str, Any], sync: bool = False) -> float:
        """Write ``state`` as the checkpoint of ``step``; in the background for an async writer unless ``sync``.
        Returns the seconds the caller was blocked (for a background save: waiting for the previous one, copying
        the state)."""
        started = time.perf_counter()
        self.wait()  # at most one save in flight: bounded memory, and manifests appear in step order
        if self._background is None or sync:
            began = time.perf_counter()
            checkpoint.save(self.directory, step, state, self.keep_last, self.writer_rank, prune_old=False)
            self.last_write_s = time.perf_counter() - began
            # Deleting the oldest checkpoint is off the training thread: unlinking a multi-GB file (and, on a file
            # system mounted with discard, trimming its blocks at the next journal commit) cost 0.3 to 1.5 s here,
            # a third of the save itself. The checkpoint just written is complete either way.
            self._pruning = self._pruner.submit(checkpoint.prune, self.directory, self.keep_last)
            return time.perf_counter() - started
        began = time.perf_counter()
        snapshot = self._staging.copy(state)
        blocked = time.perf_counter() - started
        self._pending = self._background.submit(self._write, step, snapshot, began)
        self._pending_step = step
        log.info("checkpoint step %d: state copied in %.2f s, writing in the background", step,
                 time.perf_counter() - began)  # fmt: skip
        return blocked

    def _write(self, step: int, snapshot: dict[str, Any], began: float) -> checkpoint.CheckpointInfo:
        try:
            info = checkpoint.save(self.directory, step, snapshot, self.keep_last, self.writer_rank)
        except BaseException:
            # Logged now, with its traceback: the training thread learns of it only at its next wait.
            log.exception("the checkpoint of step %d failed in the background", step)
            raise
        self.last_write_s = time.perf_counter() - began
        return info

    def wait(self) -> float:
        """Block until the save in flight, if any, is complete (manifest written), and the prune after the last
        synchronous save too. Returns the seconds waited. Raises ``CheckpointWriteError`` if the save failed."""
        started = time.perf_counter()
        self._wait_pruned()
        if self._pending is None:
            return time.perf_counter() - started
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except Exception as err:
            raise CheckpointWriteError(
                f"the checkpoint of step {self._pending_step} failed in the background: {type(err).__name__}: {err}",
                f"check free space and permissions in {self.directory}; resuming starts from the newest complete "
                "checkpoint there",
            ) from err
        return time.perf_counter() - started

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

    def close(self) -> None:
        """Wait for the save in flight (raising its failure) and stop the background thread."""
        try:
            self.wait()
        finally:
            self._staging.close()
            self._pruner.shutdown()
            if self._background is not None:
                self._background.shutdown()
