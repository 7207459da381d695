"""Host copies of a state for a checkpoint written in the background (``checkpoint.async_save``, full kind).

``Staging.start`` copies a state's tensors into host buffers kept from one checkpoint to the next (page-locked for
GPU tensors) and deep-copies everything else, so the copy shares nothing mutable with training. Storages named
``later`` (the optimizer's parameters and state, which only its step changes) are copied while training goes on:
in threads on the CPU, on a side stream on a GPU. The ``Copying`` it returns is fenced by the training thread before
anything may change them (the next optimizer step: ``FullWriter``'s step pre-hook) and waited for by the writer
before it reads the copy. Everything else (buffers, which a forward changes; plain values) is copied before
``start`` returns, or, on a GPU, ahead of the next step's kernels on the training stream.

torchtitan overlaps its checkpoint staging with the next forward and backward the same way (it waits before the
optimizer step).
"""

from __future__ import annotations

import copy
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Collection, Iterator, Optional

import numpy as np
import torch
from torch import nn

StorageKey = tuple[torch.device, int]  # a storage's device and address


def storage_key(tensor: torch.Tensor) -> StorageKey:
    storage = tensor.untyped_storage()
    return storage.device, storage.data_ptr()


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


HostCopy = tuple[np.ndarray, np.ndarray]  # (to, from)


def _copy_all(pieces: list[HostCopy]) -> None:
    for to, source in pieces:
        np.copyto(to, source)


def _copy_threads() -> int:
    """Copy threads: one per CPU this process may run on (its affinity: Slurm's share of the node), at most 8."""
    return min(8, max(torch.get_num_threads(), len(os.sched_getaffinity(0))))


class Copying:
    """The copies of a ``Staging.start`` still running: host copies in threads, GPU copies on streams."""

    def __init__(
        self,
        futures: list[Future[None]],
        ahead: list[torch.cuda.Event],
        side: list[tuple[torch.device, torch.cuda.Event]],
    ) -> None:
        self._futures = futures  # the host copies of ``later`` storages
        self._ahead = ahead  # recorded on each device's training stream after the copies queued on it
        self._side = side  # recorded on each device's side stream after the copies of ``later`` storages

    def fence(self) -> None:
        """In the training thread, before the ``later`` storages may change: host copies complete; the training
        streams wait (on the GPU, not the host) for the side streams' copies."""
        for future in self._futures:
            future.result()
        for device, event in self._side:
            torch.cuda.current_stream(device).wait_event(event)

    def wait(self) -> None:
        """Every copy complete: the copy may be read (the writer, before it writes)."""
        for future in self._futures:
            future.result()
        for event in self._ahead + [event for _, event in self._side]:
            event.synchronize()


class Staging:
    """Host copies of states' tensors, in buffers reused from one copy to the next."""

    def __init__(self) -> None:
        self._buffers: list[tuple[torch.UntypedStorage, bool]] = []  # (buffer, pinned), by first use in the state
        self._copiers: Optional[ThreadPoolExecutor] = None
        self._copier_threads = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # a side stream per GPU, for ``later`` copies
        self._copying: Optional[Copying] = None

    def copy(self, state: dict[str, Any]) -> dict[str, Any]:
        """``start`` with nothing left for later, complete when it returns."""
        snapshot, copying = self.start(state)
        copying.wait()
        return snapshot

    def start(self, state: dict[str, Any], later: Collection[StorageKey] = ()) -> tuple[dict[str, Any], Copying]:
        """A copy of ``state`` that shares nothing mutable with it: every tensor on the CPU in a staging buffer,
        everything else deep-copied. Tensors that share a storage share one buffer, with their own offsets and
        strides, so ``torch.save`` writes the copy exactly as it would write ``state`` (on the CPU, byte for
        byte). The storages in ``later`` are still being copied when this returns: see ``Copying``."""
        if self._copying is not None:
            self._copying.wait()  # the buffers are reused: the last copy into them is complete first
        staged: dict[StorageKey, torch.UntypedStorage] = {}  # a source storage -> its buffer
        memo: dict[int, Any] = {}  # for deepcopy: each tensor (by id) -> its copy
        now: list[HostCopy] = []
        deferred: list[HostCopy] = []
        on_gpu: set[torch.device] = set()
        for tensor in _tensors(state):
            if id(tensor) in memo:
                continue
            if tensor.layout != torch.strided:  # sparse and the like have no one storage: a plain copy
                memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
                continue
            source, key = tensor.untyped_storage(), storage_key(tensor)
            buffer = staged.get(key) if key[1] else None  # storages of no bytes all have address 0: never shared
            if buffer is None:
                buffer = self._buffer(len(staged), source.nbytes(), pin=source.device.type == "cuda")
                if source.device.type == "cpu":
                    (deferred if key in later else now).append((_bytes(buffer).numpy(), _bytes(source).numpy()))
                elif source.device.type == "cuda":
                    # Into page-locked memory: asynchronous. On the training stream, the copy reads the tensor
                    # before any kernel queued after it (the next forward) changes it; on the side stream, it runs
                    # alongside the next forward and backward, which do not change ``later`` storages.
                    stream = self._side_stream(source.device) if key in later else None
                    with torch.cuda.device(source.device), torch.cuda.stream(stream):
                        _bytes(buffer).copy_(_bytes(source), non_blocking=True)
                    on_gpu.add(source.device)
                else:
                    _bytes(buffer).copy_(_bytes(source))
                staged[key] = buffer
            view = torch.empty(0, dtype=tensor.dtype).set_(
                buffer, tensor.storage_offset(), tensor.size(), tensor.stride()
            )
            view.requires_grad_(tensor.requires_grad)
            memo[id(tensor)] = nn.Parameter(view, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else view
        self._copy_host(now)
        futures = self._copy_host_later(deferred)
        ahead = [self._record(torch.cuda.current_stream(device)) for device in on_gpu]
        side = [(device, self._record(stream)) for device, stream in self._streams.items() if device in on_gpu]
        self._copying = Copying(futures, ahead, side)
        # Plain values (positions, RNG states, the config) are copied too: the caller may change them after.
        return copy.deepcopy(state, memo), self._copying

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """``device``'s side stream, made to wait for what is queued on its training stream (the last optimizer
        step, which wrote the state)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _pool(self) -> ThreadPoolExecutor:
        """The copy threads (``_copy_threads``): per CPU, not per thread torch computes with: training is blocked for
        the copies made at once, so those CPUs are otherwise idle (1.2 GB: 0.145 s on 1 thread, 0.109 s on 2 here).
        Memory bandwidth is spent well before 8."""
        threads = _copy_threads()
        if self._copier_threads != threads:
            if self._copiers is not None:
                self._copiers.shutdown()
            self._copiers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-copy")
            self._copier_threads = threads
        assert self._copiers is not None
        return self._copiers

    def _copy_host(self, pieces: list[HostCopy]) -> None:
        """numpy's copy is a plain memcpy, 1.7x the bandwidth of torch's CPU copy kernel here (1.2 GB: 0.19 vs
        0.33 s), but one thread: storages go to the pool's threads (numpy releases the GIL). Each is copied whole:
        memcpy streams a large copy past the cache (64 MB at once: 4.1 GB/s, in 32 MB slices: 2.8 GB/s here)."""
        if len(pieces) > 1 and _copy_threads() > 1:
            for _ in self._pool().map(lambda piece: np.copyto(*piece), pieces):
                pass
        else:
            _copy_all(pieces)

    def _copy_host_later(self, pieces: list[HostCopy]) -> list[Future[None]]:
        """Copies that run while training goes on, on the CPUs training leaves free (at least one): more threads
        would take CPUs from the forward and backward they overlap. With 1 of 2 CPUs training, a 1.2 GB state's
        copy slowed the 100M model's forward and backward by 0.036 s here; copied first, on both, it cost 0.097 s."""
        if not pieces:
            return []
        threads = max(1, min(8, len(os.sched_getaffinity(0)) - torch.get_num_threads()))
        chunks: list[list[HostCopy]] = [[] for _ in range(threads)]
        loads = [0] * threads
        for piece in sorted(pieces, key=lambda piece: -piece[0].nbytes):  # largest first, to the least loaded
            least = loads.index(min(loads))
            chunks[least].append(piece)
            loads[least] += piece[0].nbytes
        return [self._pool().submit(_copy_all, chunk) for chunk in chunks if chunk]

    def close(self) -> None:
        if self._copying is not None:
            self._copying.wait()
            self._copying = None
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
