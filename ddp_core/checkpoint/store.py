"""Crash-safe checkpoints: data first, a manifest written last, checksums verified on load, keep-last-k.

Two kinds share the manifest ``step_XXXXXXXX.json`` (``kind`` field) and everything built on it (find the
newest verified one, prune):

- ``full``: one file ``step_XXXXXXXX.pt`` written by rank 0 (``save`` here; ``ddp_core.checkpoint.full`` runs it in
  the background for ``checkpoint.async_save``): atomic write, manifest with its size and checksum.
- ``sharded``: a folder ``step_XXXXXXXX.dcp/`` every rank wrote its shard into (``ddp_core.checkpoint.sharded``);
  the manifest lists each file's size and sha256.

The manifest is written only after the data is durable, so a kill at any moment leaves either a complete
checkpoint or something ``find_latest`` skips. Where the files go is a ``storage.Storage``: a local folder (a
temporary file renamed into place) or object storage (``checkpoint.dir`` = ``s3://...``: objects that appear whole
once uploaded, no rename); the rule is the same for both, and prune removes a manifest before its data. A step
saved again (an attempt resumed at its last step) is written beside the copy its manifest vouches for, under the
step's other name (``step_XXXXXXXX.1.pt``), and the manifest is replaced in one write: never removed first.

A full checkpoint's checksum is xxh3-128 (``checksum`` and ``digest`` in its manifest), computed on the bytes as
``torch.save`` streams them: at ~8 GB/s it adds little to a save, where sha256 (1.2 GB/s here) added most of a
second per GB, and verifying on load is as fast. The checksum catches torn and corrupt files; it is no defence
against whoever can write the checkpoint (they can rewrite the manifest, sha256 or not): loading with
``weights_only=True`` is. Manifests written before (a ``sha256`` field) still verify. Without the xxhash package
(a bare GPU box) saves fall back to sha256. Sharded checkpoints keep sha256 per file: every rank hashes its own
share, in parallel.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import socket
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ddp_core.checkpoint import loadable
from ddp_core.checkpoint.storage import MANIFEST, Location, Storage, at
from ddp_core.distributed import collectives
from ddp_core.errors import DdpJobError

try:
    import xxhash
except ImportError:  # a bare GPU box with torch alone (bench/gpu_check.py): sha256, slower, still correct
    xxhash = None  # type: ignore[assignment]  # the module or None: CHECKSUM below chooses

log = logging.getLogger(__name__)

_NAME = MANIFEST
# Names the step of the best checkpoint (checkpoint.monitor); prune keeps that one whatever keep_last says.
BEST = "best.json"


FULL, SHARDED = "full", "sharded"
TWIN = ".1"  # a re-saved step's data beside the copy its manifest still vouches for (``beside``)

_KNOWN_CHECKSUMS = ("xxh3_128", "sha256")
_CHECKSUMS: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256}
if xxhash is not None:
    _CHECKSUMS["xxh3_128"] = xxhash.xxh3_128
CHECKSUM = "xxh3_128" if "xxh3_128" in _CHECKSUMS else "sha256"  # what new full checkpoints record


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Location  # the .pt file (full) or the .dcp folder (sharded): a local path, or a URL in object storage
    digest: str  # the file's checksum (full); sha256 of the manifest's per-file sha256s (sharded)
    size: int  # bytes, all files together
    kind: str = FULL

    @property
    def name(self) -> str:
        """The file's (full) or folder's (sharded) own name: ``step_00000010.pt``."""
        return split(self.path)[1]


def split(location: Location) -> tuple[Storage, str]:
    """(the storage of a checkpoint file's folder, its name in it)."""
    if isinstance(location, Path):
        return at(location.parent), location.name
    folder, _, name = str(location).rstrip("/").rpartition("/")
    return at(folder), name


def save(
    directory: Location,
    step: int,
    state: dict[str, Any],
    keep_last: int,
    writer_rank: int = 0,
    prune_old: bool = True,
    level: int = logging.INFO,
    private: bool = False,
) -> CheckpointInfo:
    """Atomically write ``state`` for ``step``, then its manifest, then (``prune_old``) prune to the newest
    ``keep_last``: a caller that prunes in the background passes False. ``level``: of the line saying it is saved.
    ``directory``: a local folder or an object storage URL (``storage``); ``private``: a local folder of this user's
    alone (the node-local tier's: files 0600). A step that is there already (an attempt resumed at its last step
    saves it again) is written beside it and swapped in (``beside``)."""
    storage = at(directory, private)
    started = time.perf_counter()
    manifest_name = f"step_{step:08d}.json"
    name, replaced = beside(storage, step, ".pt")
    hasher = _CHECKSUMS[CHECKSUM]()
    # Streamed: no second in-memory copy of a multi-GB state. torch.save needs only write() of a file object.
    size = storage.write_data(name, lambda f: torch.save(state, f), hasher)
    digest = hasher.hexdigest()
    manifest = {
        "step": step,
        "kind": FULL,
        "file": name,
        "checksum": CHECKSUM,
        "digest": digest,
        "size": size,
        "time": time.time(),
        "writer": {"rank": writer_rank, "host": socket.gethostname(), "pid": os.getpid()},
    }
    try:
        storage.write_text(manifest_name, json.dumps(manifest, indent=1) + "\n")  # last: it vouches for the data
    except BaseException:
        storage.remove(name)  # no manifest vouches for it: a full disk gets its space back at once
        raise
    if replaced is not None:
        storage.remove(replaced)  # the earlier copy of this step, which no manifest vouches for any more
    info = CheckpointInfo(step=step, path=storage.child(name), digest=digest, size=size)
    took = time.perf_counter() - started
    log.log(level, "checkpoint step %d saved (%.1f MB, %.2f s): %s", step, size / 1e6, took, info.path)
    if prune_old:
        prune(directory, keep_last)
    return info


def data_names(step: int, suffix: str) -> tuple[str, str]:
    """The two names a step's data may have (``suffix``: ``.pt`` or ``.dcp``): ``step_XXXXXXXX.pt``, and its twin
    ``step_XXXXXXXX.1.pt``, which a re-save of the step writes while the manifest still vouches for the other."""
    return f"step_{step:08d}{suffix}", f"step_{step:08d}{TWIN}{suffix}"


def beside(storage: Storage, step: int, suffix: str) -> tuple[str, Optional[str]]:
    """(the name new data of ``step`` goes under, the data it replaces once its manifest is written, or None).

    A step whose manifest vouches for data already (an attempt resumed at its last step saves it again) gets the
    other of its two names: its manifest is then replaced in one atomic write (a rename, one PUT), so at every
    instant, and after a failure at any point of the re-save, ``find_latest`` finds a complete copy of the step.
    Whatever is under the other name, no manifest vouches for: it is overwritten."""
    try:
        current = _read_manifest(storage, f"step_{step:08d}.json")["file"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, or one no reader would trust
        current = None
    first, twin = data_names(step, suffix)
    if current is None:
        return first, None
    return (twin if current == first else first), current


def _manifests(storage: Storage) -> list[tuple[int, str]]:
    found = [(int(m[1]), name) for name in storage.names() if (m := _NAME.match(name))]
    return sorted(found, reverse=True)


def remove_data(path: Path) -> None:
    """Delete a checkpoint's data: a file, or a sharded checkpoint's folder."""
    at(path.parent).remove(path.name)


def prune(directory: Location, keep_last: int) -> None:
    storage = at(directory)
    best = best_step(directory)
    manifests = _manifests(storage)
    for step, manifest in manifests[keep_last:]:
        if step == best:
            continue
        # Manifest first: a kill between the deletions leaves orphan data, never a manifest pointing at nothing.
        storage.remove(manifest)
        for name in (*data_names(step, ".pt"), *data_names(step, ".dcp")):
            storage.remove(name)
    newest = manifests[0][0] if manifests else -1
    names = storage.names()
    kept = {name for step, _ in manifests for suffix in (".pt", ".dcp") for name in data_names(step, suffix)}
    for name in names:
        # What a killed save left: a temporary file, or (object storage, where data is written in place) the data
        # of an older step whose manifest never came. A newer step's data may be a save in flight: left alone.
        if name.startswith(".step_") and ".tmp" in name:
            storage.remove(name)
        elif storage.in_place and (m := _DATA.match(name)) and name not in kept and int(m[1]) < newest:
            storage.remove(name)
    for step, _ in manifests:
        # Both names of a kept step: a re-save killed between its manifest and the removal of the copy it replaced.
        for suffix in (".pt", ".dcp"):
            if all(name in names for name in data_names(step, suffix)):
                extra, vouched = beside(storage, step, suffix)
                if vouched is not None:
                    storage.remove(extra)


_DATA = re.compile(r"^step_(\d{8})(?:\.1)?\.(pt|dcp)$")


def file_digest(path: Location, algorithm: str) -> str:
    """A file's checksum (``algorithm``: one of ``_CHECKSUMS``), read in chunks."""
    storage, name = split(path)
    hasher = _CHECKSUMS[algorithm]()
    with storage.open_read(name) as f:
        while chunk := f.read(1 << 24):  # 16 MiB at a time: a multi-GB checkpoint is never in memory twice
            hasher.update(chunk)
    return hasher.hexdigest()


def bytes_digest(data: Any, algorithm: str) -> str:
    """The checksum of bytes in memory (a full checkpoint's file received from another rank)."""
    hasher = _CHECKSUMS[algorithm]()
    hasher.update(data)
    return hasher.hexdigest()


def recorded_checksum(manifest: Location) -> tuple[str, str]:
    """(algorithm, digest) a full checkpoint's manifest records. Raises ``ValueError`` for a malformed one."""
    return _full_checksum(_read_manifest(*split(manifest)))


def sha256_file(path: Location) -> str:
    return file_digest(path, "sha256")


def files_digest(files: dict[str, dict[str, Any]]) -> str:
    """One digest for a sharded checkpoint: sha256 over its files' names and digests, in name order."""
    return hashlib.sha256("".join(f"{name}:{files[name]['sha256']}\n" for name in sorted(files)).encode()).hexdigest()


def _verify_sharded(storage: Storage, manifest: str, meta: dict[str, Any]) -> Optional[CheckpointInfo]:
    folder = meta["file"]
    files: dict[str, dict[str, Any]] = meta["files"]
    for name, expected in sorted(files.items()):
        try:
            size = storage.size(f"{folder}/{name}")
        except OSError:
            log.warning("skipping checkpoint %s: shard file %s is missing", folder, name)
            return None
        if size != expected["size"]:
            log.warning(
                "skipping checkpoint %s: %s has %d bytes, not %d (truncated?)", folder, name, size, expected["size"]
            )
            return None
        if sha256_file(storage.child(f"{folder}/{name}")) != expected["sha256"]:
            log.warning("skipping checkpoint %s: sha256 mismatch in %s (corrupt)", folder, name)
            return None
    size = sum(f["size"] for f in files.values())
    step = _step_of(manifest)
    return CheckpointInfo(step=step, path=storage.child(folder), digest=files_digest(files), size=size, kind=SHARDED)


def _step_of(manifest: str) -> int:
    return int(_NAME.match(manifest)[1])  # type: ignore[index]  # _manifests lists only matching names


def _read_manifest(storage: Storage, manifest: str) -> dict[str, Any]:
    """A manifest's fields, checked: it names its own step's data file and nothing else (no '..', no path)."""
    meta = json.loads(storage.read_bytes(manifest))
    if not isinstance(meta, dict):
        raise ValueError(f"holds a {type(meta).__name__}, not an object")
    kind = meta.get("kind", FULL)
    if not (named := _NAME.match(manifest)):
        raise ValueError("not a checkpoint manifest's name")
    expected = data_names(int(named[1]), ".dcp" if kind == SHARDED else ".pt")
    if meta.get("file") not in expected:
        raise ValueError(f"names the file {meta.get('file')!r}, not {' or '.join(map(repr, expected))}")
    if kind == SHARDED:
        files = meta.get("files")
        if not isinstance(files, dict) or any(
            not isinstance(f, dict) or "/" in n or n in ("", ".", "..") for n, f in files.items()
        ):
            raise ValueError("its file list is not a mapping of plain file names")
    elif not isinstance(meta.get("size"), int):
        raise ValueError("size missing")
    else:
        _full_checksum(meta)
    return meta


def _full_checksum(meta: dict[str, Any]) -> tuple[str, str]:
    """(algorithm, digest) of a full checkpoint's manifest: its ``checksum`` and ``digest``, or the ``sha256`` of a
    manifest written before checksums were named."""
    if "checksum" not in meta:
        algorithm, digest = "sha256", meta.get("sha256")
    else:
        algorithm, digest = meta["checksum"], meta.get("digest")
        if algorithm not in _KNOWN_CHECKSUMS:
            raise ValueError(f"names the checksum {algorithm!r}, not one of {', '.join(_KNOWN_CHECKSUMS)}")
        if algorithm not in _CHECKSUMS:
            # Not skipped: a run would silently restart from scratch on a machine that lacks the package.
            raise DdpJobError(
                f"checkpoint manifest {meta.get('file')} is checksummed with {algorithm}, and the Python package "
                "xxhash is not installed here",
                "pip install xxhash (a dependency of ddpjob) where the trainer runs",
            )
    if not isinstance(digest, str):
        raise ValueError(f"its {algorithm} digest is missing")
    return algorithm, digest


def verify(manifest: Location) -> Optional[CheckpointInfo]:
    """The checkpoint named by ``manifest`` if its data is complete and its checksums match; None (with a
    warning) for anything else, a malformed or hostile manifest included."""
    storage, manifest_name = split(manifest)
    try:
        meta = _read_manifest(storage, manifest_name)
        if meta.get("kind", FULL) == SHARDED:
            return _verify_sharded(storage, manifest_name, meta)
        name = meta["file"]
        size = storage.size(name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("skipping checkpoint %s: unreadable manifest or missing data (%s)", manifest_name, err)
        return None
    if size != meta["size"]:
        log.warning("skipping checkpoint %s: size %d != %d in its manifest (truncated?)", name, size, meta["size"])
        return None
    algorithm, expected = _full_checksum(meta)
    path = storage.child(name)
    digest = file_digest(path, algorithm)
    if digest != expected:
        log.warning("skipping checkpoint %s: %s mismatch (corrupt)", name, algorithm)
        return None
    return CheckpointInfo(step=_step_of(manifest_name), path=path, digest=digest, size=size)


def find_latest(directory: Location) -> Optional[CheckpointInfo]:
    """Newest complete, verified checkpoint; incomplete or corrupt newer ones are skipped with a warning."""
    storage = at(directory)
    for _, manifest in _manifests(storage):
        info = verify(storage.child(manifest))
        if info is not None:
            return info
    return None


def find(directory: Location, step: int) -> Optional[CheckpointInfo]:
    """The checkpoint of ``step`` if it exists and verifies."""
    storage, manifest = at(directory), f"step_{step:08d}.json"
    return verify(storage.child(manifest)) if manifest in storage.names() else None


def steps(directory: Location) -> list[int]:
    """The steps of the checkpoints whose manifests are there (verified or not), oldest first."""
    return sorted(step for step, _ in _manifests(at(directory)))


def mark_best(directory: Location, step: int, metric: str, value: float) -> None:
    """Rank 0: the checkpoint of ``step`` is the best so far (written after it, or as it is written in the
    background: prune spares the step either way). The previous best is pruned by the next save, if old enough."""
    at(directory).write_text(BEST, json.dumps({"step": step, "metric": metric, "value": value}) + "\n")


def best_step(directory: Location) -> Optional[int]:
    try:
        step = json.loads(at(directory).read_bytes(BEST))["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def find_best(directory: Location) -> Optional[CheckpointInfo]:
    """The best checkpoint (``mark_best``) if one is marked and it verifies."""
    step = best_step(directory)
    return find(directory, step) if step is not None else None


def find_latest_agreed(directory: Location) -> Optional[CheckpointInfo]:
    """``find_latest`` on rank 0, told to every rank: each file is hashed once, not once per rank, and all
    ranks resume from the same checkpoint even if a newer one appeared meanwhile."""
    if collectives.alone():
        return find_latest(directory)
    box = [find_latest(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load(info: CheckpointInfo) -> dict[str, Any]:
    # weights_only=True: a checkpoint file can never run code on load.
    if isinstance(info.path, Path):
        return loadable.load(info.path)
    storage, name = split(info.path)
    return loadable.load(io.BytesIO(storage.read_bytes(name)))


def done_within(pending: Optional[futures.Future[Any]], within_s: float) -> bool:
    """Whether a writer's save in flight (``pending``; None: none) is done, waiting at most ``within_s`` for it."""
    if pending is not None:
        futures.wait([pending], timeout=max(0.0, within_s))
    return pending is None or pending.done()
