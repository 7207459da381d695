"""Crash-safe checkpoints: data first, a manifest written last, checksums verified on load, keep-last-k.

Two kinds share the manifest ``step_XXXXXXXX.json`` (``kind`` field) and everything built on it (find the
newest verified one, prune):

- ``full``: one file ``step_XXXXXXXX.pt`` written by rank 0 (``save`` here; ``ddp_core.checkpoint.full`` runs it in
  the background for ``checkpoint.async_save``): atomic write, manifest with its size and checksum.
- ``sharded``: a folder ``step_XXXXXXXX.dcp/`` every rank wrote its shard into (``ddp_core.checkpoint.sharded``);
  the manifest lists each file's size and sha256.

The manifest is written only after the data is durable, so a kill at any moment leaves either a complete
checkpoint or something ``find_latest`` skips.

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
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, Callable, Optional, cast

import torch
import torch.distributed as dist

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import atomic_write_text, fsync_dir

try:
    import xxhash
except ImportError:  # a bare GPU box with torch alone (bench/gpu_check.py): sha256, slower, still correct
    xxhash = None  # type: ignore[assignment]  # the module or None: CHECKSUM below chooses

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})\.json$")
# Names the step of the best checkpoint (checkpoint.monitor); prune keeps that one whatever keep_last says.
BEST = "best.json"


FULL, SHARDED = "full", "sharded"

_KNOWN_CHECKSUMS = ("xxh3_128", "sha256")
_CHECKSUMS: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256}
if xxhash is not None:
    _CHECKSUMS["xxh3_128"] = xxhash.xxh3_128
CHECKSUM = "xxh3_128" if "xxh3_128" in _CHECKSUMS else "sha256"  # what new full checkpoints record
# Writeback of a file being saved starts every this many bytes, so the fsync at its end has little left to do.
_FLUSH_EVERY = 128 << 20


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path  # the .pt file (full) or the .dcp folder (sharded)
    digest: str  # the file's checksum (full); sha256 of the manifest's per-file sha256s (sharded)
    size: int  # bytes, all files together
    kind: str = FULL


class _DurableWriter(io.RawIOBase):
    """The write-only file object ``torch.save`` streams into: checksums the bytes on their way to the file (no
    second pass over it), and starts the disk's writeback every ``_FLUSH_EVERY`` bytes in a thread of its own, so
    the fsync in ``finish`` overlaps serialisation instead of following it."""

    def __init__(self, f: BinaryIO, algorithm: str) -> None:
        self.f, self.hash, self.size = f, _CHECKSUMS[algorithm](), 0
        self._unflushed = 0
        self._flusher: Optional[threading.Thread] = None
        self._flush_error: Optional[OSError] = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.f.write(view)  # a BufferedWriter: writes all of it, or raises
        self.size += view.nbytes
        self._unflushed += view.nbytes
        if self._unflushed >= _FLUSH_EVERY and (self._flusher is None or not self._flusher.is_alive()):
            self._unflushed = 0
            self.f.flush()
            self._flusher = threading.Thread(target=self._flush, name="ckpt-flush", daemon=True)
            self._flusher.start()
        return view.nbytes

    def _flush(self) -> None:
        try:
            os.fdatasync(self.f.fileno())
        except OSError as err:
            # Reported here, and maybe not again to the final fsync (Linux reports a writeback error once per fd).
            self._flush_error = err

    def finish(self) -> str:
        """Make everything written durable; returns the checksum."""
        self.f.flush()
        if self._flusher is not None:
            self._flusher.join()
        if self._flush_error is not None:
            raise self._flush_error
        os.fsync(self.f.fileno())
        return self.hash.hexdigest()


def save(
    directory: Path,
    step: int,
    state: dict[str, Any],
    keep_last: int,
    writer_rank: int = 0,
    prune_old: bool = True,
    level: int = logging.INFO,
) -> CheckpointInfo:
    """Atomically write ``state`` for ``step``, then its manifest, then (``prune_old``) prune to the newest
    ``keep_last``: a caller that prunes in the background passes False. ``level``: of the line saying it is saved."""
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    final = directory / f"step_{step:08d}.pt"
    manifest_path = final.with_suffix(".json")
    tmp = directory / f".step_{step:08d}.pt.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            writer = _DurableWriter(f, CHECKSUM)
            # Streamed: no second in-memory copy of a multi-GB state. torch.save needs only write() of a file object.
            torch.save(state, cast(IO[bytes], writer))
            digest = writer.finish()
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file (a kill leaves one for prune)
        raise
    size = writer.size
    # This step's checkpoint from an earlier attempt (one resumed at its last step saves it again) is replaced
    # manifest first: a kill in between loses this step, never pairs a manifest with other data.
    manifest_path.unlink(missing_ok=True)
    os.replace(tmp, final)
    fsync_dir(directory)
    manifest = {
        "step": step,
        "kind": FULL,
        "file": final.name,
        "checksum": CHECKSUM,
        "digest": digest,
        "size": size,
        "time": time.time(),
        "writer": {"rank": writer_rank, "host": socket.gethostname(), "pid": os.getpid()},
    }
    atomic_write_text(manifest_path, json.dumps(manifest, indent=1) + "\n")  # durable when it returns (dir too)
    info = CheckpointInfo(step=step, path=final, digest=digest, size=size)
    took = time.perf_counter() - started
    log.log(level, "checkpoint step %d saved (%.1f MB, %.2f s): %s", step, size / 1e6, took, final)
    if prune_old:
        prune(directory, keep_last)
    return info


def _manifests(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def remove_data(path: Path) -> None:
    """Delete a checkpoint's data: a file, or a sharded checkpoint's folder."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune(directory: Path, keep_last: int) -> None:
    best = best_step(directory)
    for step, manifest in _manifests(directory)[keep_last:]:
        if step == best:
            continue
        # Manifest first: a kill between the unlinks leaves orphan data, never a manifest pointing at nothing.
        manifest.unlink(missing_ok=True)
        remove_data(manifest.with_suffix(".pt"))
        remove_data(manifest.with_suffix(".dcp"))
    for stale in directory.glob(".step_*.tmp*"):
        remove_data(stale)


def file_digest(path: Path, algorithm: str) -> str:
    """A file's checksum (``algorithm``: one of ``_CHECKSUMS``), read in chunks."""
    hasher = _CHECKSUMS[algorithm]()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):  # 16 MiB at a time: a multi-GB checkpoint is never in memory twice
            hasher.update(chunk)
    return hasher.hexdigest()


def bytes_digest(data: Any, algorithm: str) -> str:
    """The checksum of bytes in memory (a full checkpoint's file received from another rank)."""
    hasher = _CHECKSUMS[algorithm]()
    hasher.update(data)
    return hasher.hexdigest()


def recorded_checksum(manifest: Path) -> tuple[str, str]:
    """(algorithm, digest) a full checkpoint's manifest records. Raises ``ValueError`` for a malformed one."""
    return _full_checksum(_read_manifest(manifest))


def sha256_file(path: Path) -> str:
    return file_digest(path, "sha256")


def files_digest(files: dict[str, dict[str, Any]]) -> str:
    """One digest for a sharded checkpoint: sha256 over its files' names and digests, in name order."""
    return hashlib.sha256("".join(f"{name}:{files[name]['sha256']}\n" for name in sorted(files)).encode()).hexdigest()


def _verify_sharded(manifest: Path, meta: dict[str, Any]) -> Optional[CheckpointInfo]:
    folder = manifest.with_name(meta["file"])
    files: dict[str, dict[str, Any]] = meta["files"]
    for name, expected in sorted(files.items()):
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            log.warning("skipping checkpoint %s: shard file %s is missing", folder.name, name)
            return None
        if size != expected["size"]:
            log.warning(
                "skipping checkpoint %s: %s has %d bytes, not %d (truncated?)",
                folder.name,
                name,
                size,
                expected["size"],
            )
            return None
        if sha256_file(path) != expected["sha256"]:
            log.warning("skipping checkpoint %s: sha256 mismatch in %s (corrupt)", folder.name, name)
            return None
    size = sum(f["size"] for f in files.values())
    return CheckpointInfo(step=_step_of(manifest), path=folder, digest=files_digest(files), size=size, kind=SHARDED)


def _step_of(manifest: Path) -> int:
    return int(_NAME.match(manifest.name)[1])  # type: ignore[index]  # _manifests lists only matching names


def _read_manifest(manifest: Path) -> dict[str, Any]:
    """A manifest's fields, checked: it names its own step's data file and nothing else (no '..', no path)."""
    meta = json.loads(manifest.read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"holds a {type(meta).__name__}, not an object")
    kind = meta.get("kind", FULL)
    expected = manifest.with_suffix(".dcp" if kind == SHARDED else ".pt").name
    if meta.get("file") != expected:
        raise ValueError(f"names the file {meta.get('file')!r}, not {expected!r}")
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


def verify(manifest: Path) -> Optional[CheckpointInfo]:
    """The checkpoint named by ``manifest`` if its data is complete and its checksums match; None (with a
    warning) for anything else, a malformed or hostile manifest included."""
    try:
        meta = _read_manifest(manifest)
        if meta.get("kind", FULL) == SHARDED:
            return _verify_sharded(manifest, meta)
        path = manifest.with_name(meta["file"])
        size = path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("skipping checkpoint %s: unreadable manifest or missing data (%s)", manifest.name, err)
        return None
    if size != meta["size"]:
        log.warning("skipping checkpoint %s: size %d != %d in its manifest (truncated?)", path.name, size, meta["size"])
        return None
    algorithm, expected = _full_checksum(meta)
    digest = file_digest(path, algorithm)
    if digest != expected:
        log.warning("skipping checkpoint %s: %s mismatch (corrupt)", path.name, algorithm)
        return None
    return CheckpointInfo(step=_step_of(manifest), path=path, digest=digest, size=size)


def find_latest(directory: Path) -> Optional[CheckpointInfo]:
    """Newest complete, verified checkpoint; incomplete or corrupt newer ones are skipped with a warning."""
    for _, manifest in _manifests(directory):
        info = verify(manifest)
        if info is not None:
            return info
    return None


def find(directory: Path, step: int) -> Optional[CheckpointInfo]:
    """The checkpoint of ``step`` if it exists and verifies."""
    manifest = directory / f"step_{step:08d}.json"
    return verify(manifest) if manifest.is_file() else None


def mark_best(directory: Path, step: int, metric: str, value: float) -> None:
    """Rank 0: the checkpoint of ``step`` is the best so far (written after it, or as it is written in the
    background: prune spares the step either way). The previous best is pruned by the next save, if old enough."""
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / BEST, json.dumps({"step": step, "metric": metric, "value": value}) + "\n")


def best_step(directory: Path) -> Optional[int]:
    try:
        step = json.loads((directory / BEST).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def find_best(directory: Path) -> Optional[CheckpointInfo]:
    """The best checkpoint (``mark_best``) if one is marked and it verifies."""
    step = best_step(directory)
    return find(directory, step) if step is not None else None


def find_latest_agreed(directory: Path) -> Optional[CheckpointInfo]:
    """``find_latest`` on rank 0, told to every rank: each file is hashed once, not once per rank, and all
    ranks resume from the same checkpoint even if a newer one appeared meanwhile."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return find_latest(directory)
    box = [find_latest(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load(info: CheckpointInfo) -> dict[str, Any]:
    # weights_only=True: a checkpoint file can never run code on load.
    return torch.load(info.path, map_location="cpu", weights_only=True)
