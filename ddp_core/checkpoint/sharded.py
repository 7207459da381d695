"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shard, in parallel.

``checkpoints/step_XXXXXXXX.dcp/`` holds DCP's files (``__<rank>_<n>.distcp`` shards and ``.metadata``) and
``extra.pt``, rank 0's small file of everything that is not a model or optimizer tensor (position, every
rank's RNG, scheduler, config, the optimizer's param groups). The folder is written under a temporary name;
once every rank's files are durable, rank 0 renames it and writes the manifest ``step_XXXXXXXX.json`` (kind
``sharded``, world size, each file's size and sha256) last, as for full checkpoints (``ddp_core.checkpoint.store``).
A step saved already goes beside its earlier copy (``step_XXXXXXXX.1.dcp``, ``store.beside``) and is swapped in.

Loading runs no code from the checkpoint: only tensors go through DCP (its path for other objects unpickles with
``weights_only=False``), the rest is in ``extra.pt`` (``weights_only=True``), and we unpickle DCP's ``.metadata``
ourselves, allowing only the exact (module, name) pairs DCP writes and refusing any non-tensor entry; DCP then
plans from that checked copy. A sharded checkpoint loads at any world size
(DCP reshards) and into any strategy, and into a single process without a process group (``ddpjob export``).

Async saves (``checkpoint.async_save``) use ``dcp.async_save`` on a gloo group of their own: on the default
group it deadlocked against training's collectives here. Training blocks while the state is copied; a
background thread on every rank then checksums its share of the files and rank 0 finishes the checkpoint
(rename, manifest, prune). Synchronous saves do the same in the training thread.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import socket
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ddp_core.checkpoint import loadable, store
from ddp_core.checkpoint import storage as storages
from ddp_core.checkpoint.storage import Location
from ddp_core.checkpoint.store import SHARDED, CheckpointInfo, files_digest, prune, remove_data, sha256_file, split
from ddp_core.distributed import collectives
from ddp_core.errors import DdpJobError
from ddp_core.run import private as privately
from ddp_core.run.rundir import fsync_dir

log = logging.getLogger(__name__)

EXTRA = "extra.pt"
DCP_METADATA = ".metadata"  # the file FileSystemWriter's coordinator writes last

# Exactly what DCP's FileSystemWriter pickles into .metadata (read off real ones): (module, qualified name) pairs,
# compared whole. No module is allowed wholesale: protocol 4 resolves a dotted name by walking attributes, so
# ('torch.distributed.checkpoint.metadata', 'torch.os.system') would be os.system.
_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)
_DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))
_BYTES_ENTRY = ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")
_Target = tuple[str, Optional[str]]  # a save's folder name, and the copy of its step it replaces (store.beside)
_REFUSED_HINT = "load only checkpoints as ddpjob wrote them: restore this one from a trusted copy or delete it"


class CheckpointRefused(DdpJobError):
    """A checkpoint whose metadata names something DCP's own writer never writes: loading it could run code."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _BYTES_ENTRY:
            raise CheckpointRefused(
                "it declares a non-tensor (bytes) entry, which ddpjob never writes and DCP would unpickle with "
                "weights_only=False"
            )
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise CheckpointRefused(f"its {DCP_METADATA} names '{module}.{name}', which is not one of DCP's metadata types")


def read_metadata(folder: Path) -> Metadata:
    """DCP's metadata of a checkpoint folder, unpickled with only DCP's own types allowed and every entry a tensor.
    Raises ``CheckpointRefused`` (saying why) for anything else: a manifest's sha256 proves integrity, not
    authorship, so whoever can write the checkpoint could otherwise make loading it run code."""
    try:
        with open(folder / DCP_METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointRefused(f"its {DCP_METADATA} holds a {type(metadata).__name__}, not DCP Metadata")
        for key, spec in metadata.state_dict_metadata.items():
            if not isinstance(spec, TensorStorageMetadata):
                raise CheckpointRefused(f"its entry '{key}' is a {type(spec).__name__}, not a tensor")
    except CheckpointRefused as err:
        raise CheckpointRefused(f"checkpoint {folder} refused: {err.message}", _REFUSED_HINT) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise CheckpointRefused(
            f"checkpoint {folder} refused: unreadable {DCP_METADATA} ({err})", _REFUSED_HINT
        ) from None
    return metadata


class _CheckedReader(dcp.FileSystemReader):
    """DCP's file reader, planning from the metadata ``read_metadata`` checked: DCP never unpickles .metadata
    itself (it would, unrestricted, and the file could have changed since the check)."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__(folder)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta = getattr(self._checked, "storage_meta", None)
        if meta is None:
            meta = self._checked.storage_meta = StorageMeta()
        meta.load_id = getattr(self, "load_id", None)
        return self._checked


def split_tensors(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A nested dict cut in two of the same shape: its tensors (for DCP) and everything else (for extra.pt)."""
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            inner_tensors, inner_plain = split_tensors(value)
            if inner_tensors:
                tensors[key] = inner_tensors
            if inner_plain or not inner_tensors:  # keeps empty dicts (an optimizer with no state yet)
                plain[key] = inner_plain
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            plain[key] = value
    return tensors, plain


def merge(tree: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``split_tensors``."""
    out = dict(tree)
    for key, value in other.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge(out[key], value) if both else value
    return out


def _save_extra(path: Path, extra: dict[str, Any], private: bool) -> None:
    with open(path, "wb", opener=privately.opener if private else None) as f:
        torch.save(extra, f)
        f.flush()
        os.fsync(f.fileno())


class ShardedWriter:
    """Writes one run's sharded checkpoints. Every rank holds one and calls ``save`` at the same step."""

    def __init__(self, directory: Location, keep_last: int, async_save: bool, rank: int, world_size: int) -> None:
        self.directory, self.keep_last, self.async_save = directory, keep_last, async_save
        self.storage = storages.at(directory)
        self.rank, self.world_size = rank, world_size
        self._pending: Optional[Future[Any]] = None
        self._group: Optional[dist.ProcessGroup] = None  # async saves' own gloo group (made at the first one)
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if async_save else None
        # Rank 0: seconds the last completed save took from its start to its manifest (what a synchronous save costs,
        # in the background or not). None before the first one.
        self.last_write_s: Optional[float] = None

    def save(self, step: int, state: dict[str, Any], extra: Optional[dict[str, Any]]) -> float:
        """Collective. ``state``: this rank's model/optimizer state (``Strategy.sharded_state``); ``extra``: the
        rest, rank 0 only. Returns the seconds training blocked (for an async save: waiting for the previous
        one, copying the state)."""
        started = time.perf_counter()
        self.wait()  # at most one save in flight: bounded memory, and manifests appear in step order
        tmp = self._staging(step)
        tensors, plain = split_tensors(state)
        if self.rank == 0 or self.storage.in_place:
            remove_data(tmp)  # left by a killed attempt: stale shards must not mix with this save's
            tmp.mkdir(parents=True, mode=privately.DIR_MODE if self.storage.in_place else 0o777)
        target: Optional[tuple[str, Optional[str]]] = None
        if self.rank == 0:
            # A step saved already (by an earlier attempt) is written beside the copy its manifest vouches for.
            target = store.beside(self.storage, step, ".dcp")
            if self.storage.in_place:
                self.storage.remove(target[0])  # stale files no manifest vouches for: none may mix with this save's
            assert extra is not None
            rest = {"plain": plain, "model_keys": list(state["model"])} | extra
            _save_extra(tmp / EXTRA, rest, self.storage.in_place)
        # The folder exists, empty of stale files, before any rank writes into it; every rank learns the name.
        target = collectives.gather_to_all(target)[0]
        assert target is not None
        writer = dcp.FileSystemWriter(tmp)  # fsyncs every file it writes
        if self._background is None:
            dcp.save(tensors, storage_writer=writer)
            self._complete(step, target, tmp, started, None)
            collectives.barrier()  # nobody runs ahead (or exits) before the manifest is written
            return time.perf_counter() - started
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        upload = dcp.async_save(tensors, storage_writer=writer, process_group=self._group)
        assert isinstance(upload, Future)
        blocked = time.perf_counter() - started
        self._pending = self._background.submit(self._complete_after, upload, step, target, tmp, started, blocked)
        return blocked

    def _staging(self, step: int) -> Path:
        """Where DCP writes this step's files: the folder's temporary name beside the checkpoints (renamed into place
        by rank 0), or, for object storage, a new private folder of this rank's own in the node's temporary folder
        (``ddp_core.run.private``: no other user reads the shards or swaps them before they are hashed; each rank
        uploads what it wrote: its shards; rank 0 also ``.metadata`` and ``extra.pt``)."""
        name = f".step_{step:08d}.dcp.tmp"
        if not self.storage.in_place:
            return Path(self.directory) / name
        return privately.temp_folder("shards") / name

    def wait(self) -> float:
        """Block until the save in flight, if any, is complete (on rank 0: manifest written). Returns seconds."""
        if self._pending is None:
            return 0.0
        started = time.perf_counter()
        pending, self._pending = self._pending, None
        pending.result()  # re-raises a failed background save here, in the training thread
        return time.perf_counter() - started

    def settle(self, within_s: float) -> bool:
        """Wait at most ``within_s`` for this rank's part of the save in flight; whether none is left (raising its
        failure, as ``wait``). The ranks agree on the answer (``CheckpointManager.settle``)."""
        if not store.done_within(self._pending, within_s):
            return False
        self.wait()
        return True

    def close(self, wait: bool = True) -> None:
        """Wait for the save in flight; call before the process group goes away. ``wait=False`` (a failed attempt):
        leave it, as its completion needs every rank."""
        if wait:
            self.wait()
        if self._background is not None:
            self._background.shutdown(wait=wait, cancel_futures=not wait)

    def _complete_after(
        self, upload: Future[Any], step: int, target: _Target, tmp: Path, started: float, blocked: float
    ) -> None:
        upload.result()  # on every rank, DCP returns once its coordinator wrote .metadata, after all shards
        self._complete(step, target, tmp, started, blocked)

    def _complete(self, step: int, target: _Target, tmp: Path, started: float, blocked: Optional[float]) -> None:
        """Collective (on the async group in the background): every rank checksums its share of the folder's
        files, so a large checkpoint is hashed in parallel, not by rank 0 alone; rank 0 finishes it. ``target``:
        (the folder's name, the copy of the step it replaces: ``store.beside``)."""
        names = sorted(p.name for p in tmp.iterdir())
        if self.storage.in_place:  # this rank's own folder: its files, uploaded (in the background if async)
            privately.seal(tmp)  # DCP's files 0600 (the folder is 0700 already)
            mine = {name: _describe(tmp / name) for name in names}
            self.storage.upload_folder(tmp, target[0])
            shutil.rmtree(tmp.parent, ignore_errors=True)
            names = []
        else:
            mine = {name: _describe(tmp / name) for name in names[self.rank :: self.world_size]}
        shares = [mine]
        if not collectives.alone():
            shares = [{} for _ in range(self.world_size)] if self.rank == 0 else []
            dist.gather_object(mine, shares if self.rank == 0 else None, dst=0, group=self._group)
        if self.rank != 0:
            return
        files = {name: info for share in shares for name, info in share.items()}
        for name in names:  # a rank that listed the folder differently (a lagging shared filesystem)
            files.setdefault(name, _describe(tmp / name))
        self._finish(step, target, tmp, dict(sorted(files.items())), started, blocked)

    def _finish(
        self,
        step: int,
        target: _Target,
        tmp: Path,
        files: dict[str, dict[str, Any]],
        started: float,
        blocked: Optional[float],
    ) -> None:
        """Rank 0: move the folder into place (every rank uploaded its files to object storage), write the manifest
        last (it replaces an earlier copy's in one write), remove the copy it replaced, prune."""
        name, replaced = target
        if not self.storage.in_place:
            fsync_dir(tmp)
            final = Path(self.directory) / name
            remove_data(final)  # no manifest vouches for it (store.beside)
            os.replace(tmp, final)
            fsync_dir(Path(self.directory))
        meta = {
            "step": step,
            "kind": SHARDED,
            "file": name,
            "world_size": self.world_size,
            "files": files,
            "size": sum(f["size"] for f in files.values()),
            "sha256": files_digest(files),
            "async": self.async_save,
            "time": time.time(),
            "writer": {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid()},
        }
        self.storage.write_text(f"step_{step:08d}.json", json.dumps(meta, indent=1) + "\n")  # durable (dir too)
        if replaced is not None:
            self.storage.remove(replaced)
        took = self.last_write_s = time.perf_counter() - started
        log.info(
            "checkpoint step %d saved (%d files, %.1f MB, %.2f s, training blocked %.2f s): %s",
            step,
            len(files),
            meta["size"] / 1e6,
            took,
            took if blocked is None else blocked,
            self.storage.child(name),
        )
        prune(self.directory, self.keep_last)


def _describe(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def load(info: CheckpointInfo, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective when a process group exists. Reads a sharded checkpoint into ``state`` (model/optimizer as
    ``Strategy.sharded_state`` gives them, at any world size) in place. Returns (that state completed with the
    checkpoint's non-tensor parts, the rest of the checkpoint: position, RNG, scheduler, ...). One in object storage
    is read from a copy in the node's temporary folder."""
    with storages.local_copy(*split(info.path)) as folder:
        return _load(folder, state)


def _load(folder: Path, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    metadata = read_metadata(folder)  # refuses a checkpoint whose loading could run code, before reading it
    extra = loadable.load(folder / EXTRA)
    tensors, own = split_tensors(state)
    dcp.load(tensors, storage_reader=_CheckedReader(folder, metadata))
    plain = extra.pop("plain")
    saved_groups = plain.get("optimizer", {}).get("param_groups")
    own_groups = own.get("optimizer", {}).get("param_groups")
    if saved_groups is not None and own_groups is not None and len(saved_groups) == len(own_groups):
        # Which parameters a group holds is this rank's own (a pipeline stage holds some, rank 0 wrote its
        # own list); the hyperparameters (lr, betas, ...) come from the checkpoint.
        plain["optimizer"]["param_groups"] = [
            saved | {"params": mine["params"]} for saved, mine in zip(saved_groups, own_groups, strict=True)
        ]
    return merge(tensors, plain), extra


def read_model_state(location: Location) -> dict[str, torch.Tensor]:
    """The whole model's weights under plain keys, in this process alone (no process group needed)."""
    with storages.local_copy(*split(location)) as folder:
        return _read_model_state(folder)


def _read_model_state(folder: Path) -> dict[str, torch.Tensor]:
    metadata = read_metadata(folder)
    extra = loadable.load(folder / EXTRA)
    specs = metadata.state_dict_metadata
    state: dict[str, torch.Tensor] = {}
    for key in extra["model_keys"]:  # the model's own state_dict order
        spec = cast(TensorStorageMetadata, specs[f"model.{key}"])  # a tensor: read_metadata refused anything else
        state[key] = torch.empty(spec.size, dtype=spec.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that it assumes a single process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, storage_reader=_CheckedReader(folder, metadata), no_dist=True)
    return state
