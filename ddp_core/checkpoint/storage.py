"""Where checkpoints live: a folder on a filesystem, or a prefix in object storage (any fsspec URL, ``s3://`` through
s3fs), behind one small interface the checkpoint format (``store``) and the sharded writer use.

- ``LocalStorage``: a folder (``RUN/checkpoints``, or a path ``checkpoint.dir`` names). A file is written to a
  temporary name, fsynced (writeback started every 128 MiB while it streams) and renamed into place: today's code
  path, unchanged.
- ``ObjectStorage``: a prefix under an fsspec URL. Object stores have no atomic rename, but an upload becomes
  visible only once complete (S3's PUT and multipart upload): each data object is written under its final name, a
  failed upload is aborted, and a killed one never appears. The format's manifest-last rule does the rest.

Credentials and a non-AWS endpoint come from the standard AWS sources (``AWS_ACCESS_KEY_ID``/``AWS_PROFILE``/an
instance role, ``AWS_ENDPOINT_URL``): nothing here takes or records them. ``at`` picks the storage of a location;
``probe`` is the login node's check of a URL before anything is submitted. Imports no torch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import secrets
import shutil
import threading
from functools import cache
from pathlib import Path
from typing import IO, Any, BinaryIO, Callable, Iterator, Optional, Union

from ddp_core.errors import DdpJobError
from ddp_core.locations import is_url  # what checkpoint.dir names: one test, shared with the config check
from ddp_core.run import private as privately
from ddp_core.run.rundir import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

# A checkpoint's manifest, named for its step: the format's (``store``), matched here for readers without torch.
MANIFEST = re.compile(r"^step_(\d{8})\.json$")

# A checkpoint folder: a local path, or an fsspec URL (``s3://bucket/prefix/run``).
Location = Union[Path, str]

# Writeback of a file being saved starts every this many bytes, so the fsync at its end has little left to do.
_FLUSH_EVERY = 128 << 20


class HashingWriter(io.RawIOBase):
    """The write-only file object ``torch.save`` streams into: hashes the bytes on their way to ``f``."""

    def __init__(self, f: IO[bytes], hasher: Any) -> None:
        self.f, self.hash, self.size = f, hasher, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.f.write(view)  # a buffered file: writes all of it, or raises
        self.size += view.nbytes
        return view.nbytes


class _DurableWriter(HashingWriter):
    """A ``HashingWriter`` into a local file that starts the disk's writeback every ``_FLUSH_EVERY`` bytes in a
    thread of its own, so the fsync in ``finish`` overlaps serialisation instead of following it."""

    def __init__(self, f: BinaryIO, hasher: Any) -> None:
        super().__init__(f, hasher)
        self.file = f
        self._unflushed = 0
        self._flusher: Optional[threading.Thread] = None
        self._flush_error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        n = super().write(data)
        self._unflushed += n
        if self._unflushed >= _FLUSH_EVERY and (self._flusher is None or not self._flusher.is_alive()):
            self._unflushed = 0
            self.file.flush()
            self._flusher = threading.Thread(target=self._flush, name="ckpt-flush", daemon=True)
            self._flusher.start()
        return n

    def _flush(self) -> None:
        try:
            os.fdatasync(self.file.fileno())
        except OSError as err:
            # Reported here, and maybe not again to the final fsync (Linux reports a writeback error once per fd).
            self._flush_error = err

    def finish(self) -> None:
        """Make everything written durable."""
        self.file.flush()
        if self._flusher is not None:
            self._flusher.join()
        if self._flush_error is not None:
            raise self._flush_error
        os.fsync(self.file.fileno())


class Storage:
    """A checkpoint folder. Names are relative to it (``step_00000010.pt``, ``step_00000010.dcp/__0_0.distcp``)."""

    where: str  # the folder, as messages show it
    in_place = False  # data is written under its final name (no rename): a killed save's data may be left there

    def child(self, name: str) -> Location:
        """The location of an entry (a ``CheckpointInfo``'s path)."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """The folder's entries (files and sub-folders), [] if it does not exist."""
        raise NotImplementedError

    def size(self, name: str) -> int:
        """An entry's size in bytes; ``OSError`` (``FileNotFoundError``) if it is missing."""
        raise NotImplementedError

    def modified(self, name: str) -> float:
        """An entry's modification time (epoch seconds); ``OSError`` if it is missing."""
        raise NotImplementedError

    def read_bytes(self, name: str) -> bytes:
        raise NotImplementedError

    def open_read(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        raise NotImplementedError

    def write_data(self, name: str, produce: Callable[[IO[bytes]], None], hasher: Any) -> int:
        """Stream ``produce``'s bytes, hashed by ``hasher``, to the entry ``name`` (one no manifest vouches for:
        ``store.beside``). Complete (durable) when it returns its size; a failure leaves no partial entry under
        ``name``."""
        raise NotImplementedError

    def write_text(self, name: str, text: str) -> None:
        """Write a small entry whole: readers see the old one or the new one, never part; durable on return."""
        raise NotImplementedError

    def remove(self, name: str) -> None:
        """Delete an entry, a file or a folder; missing is fine."""
        raise NotImplementedError

    def upload_folder(self, folder: Path, name: str) -> None:
        """Copy a local folder's files into the entry ``name`` (a sharded checkpoint written locally first)."""
        raise NotImplementedError

    def download_folder(self, name: str, folder: Path) -> None:
        """Copy the entry ``name``'s files into a local folder."""
        raise NotImplementedError


class LocalStorage(Storage):
    """``private``: a folder of this user's alone (the node-local tier's, ``ddp_core.run.private``): its folders
    are made 0700, its files 0600."""

    def __init__(self, root: Path, private: bool = False) -> None:
        self.root, self.where, self.private = root, str(root), private

    def _folder(self) -> None:
        if self.private:
            privately.makedirs(self.root)
        else:
            self.root.mkdir(parents=True, exist_ok=True)

    def child(self, name: str) -> Location:
        return self.root / name

    def names(self) -> list[str]:
        return [p.name for p in self.root.iterdir()] if self.root.is_dir() else []

    def size(self, name: str) -> int:
        return (self.root / name).stat().st_size

    def modified(self, name: str) -> float:
        return (self.root / name).stat().st_mtime

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def open_read(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return open(self.root / name, "rb")

    def write_data(self, name: str, produce: Callable[[IO[bytes]], None], hasher: Any) -> int:
        self._folder()
        final = self.root / name
        tmp = self.root / f".{name}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb", opener=privately.opener if self.private else None) as f:
                writer = _DurableWriter(f, hasher)
                produce(writer)  # type: ignore[arg-type]  # a raw writer: torch.save needs only write()
                writer.finish()
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk leaves no half file (a kill leaves one for prune)
            raise
        os.replace(tmp, final)
        fsync_dir(self.root)
        return writer.size

    def write_text(self, name: str, text: str) -> None:
        self._folder()
        atomic_write_text(self.root / name, text, self.private)  # durable when it returns (dir too)

    def remove(self, name: str) -> None:
        path = self.root / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def upload_folder(self, folder: Path, name: str) -> None:
        raise AssertionError("a local checkpoint folder is moved into place, not copied")

    def download_folder(self, name: str, folder: Path) -> None:
        raise AssertionError("a local checkpoint folder is read in place")


class ObjectStorage(Storage):
    """A prefix in object storage through fsspec. The filesystem object is fsspec's (cached per process, thread-safe
    for s3fs); listings are never served from its cache, as another process (an earlier attempt) writes here too."""

    def __init__(self, url: str) -> None:
        import fsspec  # s3fs and its botocore: imported by the runs that use object storage

        self.where, self.in_place = url.rstrip("/"), True
        self.fs, self.root = fsspec.core.url_to_fs(self.where)
        self.root = self.root.rstrip("/")

    def child(self, name: str) -> Location:
        return f"{self.where}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]

    def _info(self, name: str) -> dict[str, Any]:
        self.fs.invalidate_cache(self._path(name))
        info: dict[str, Any] = self.fs.info(self._path(name))
        return info

    def size(self, name: str) -> int:
        return int(self._info(name)["size"])

    def modified(self, name: str) -> float:
        info = self._info(name)
        stamp: Any = info.get("LastModified") or info.get("mtime") or info.get("created")
        return float(stamp.timestamp() if hasattr(stamp, "timestamp") else stamp)

    def read_bytes(self, name: str) -> bytes:
        data: bytes = self.fs.cat_file(self._path(name))
        return data

    def open_read(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        handle: IO[bytes] = self.fs.open(self._path(name), "rb", block_size=64 << 20)
        return handle

    def write_data(self, name: str, produce: Callable[[IO[bytes]], None], hasher: Any) -> int:
        f = self.fs.open(self._path(name), "wb", block_size=64 << 20)
        writer = HashingWriter(f, hasher)
        try:
            produce(writer)  # type: ignore[arg-type]  # a raw writer: torch.save needs only write()
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # aborts the multipart upload: nothing of it appears
            f.closed = True  # closing it now would complete the upload with what was written
            raise
        f.close()  # completes the upload: the object appears whole
        return writer.size

    def write_text(self, name: str, text: str) -> None:
        self.fs.pipe_file(self._path(name), text.encode())  # one PUT: the object appears whole

    def remove(self, name: str) -> None:
        path = self._path(name)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(path)

    def upload_folder(self, folder: Path, name: str) -> None:
        for path in sorted(folder.iterdir()):
            self.fs.put_file(str(path), self._path(f"{name}/{path.name}"))

    def download_folder(self, name: str, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.fs.invalidate_cache(self._path(name))
        for path in self.fs.ls(self._path(name), detail=False):
            self.fs.get_file(path, str(folder / str(path).rsplit("/", 1)[-1]))


def at(location: Location, private: bool = False) -> Storage:
    """The storage of a checkpoint folder: object storage for a URL, else the local folder (``private``: see
    ``LocalStorage``)."""
    if is_url(location):
        return ObjectStorage(str(location))
    return LocalStorage(Path(str(location).removeprefix("file://")), private)


def newest_manifest_time(location: Location) -> Optional[float]:
    """When the newest checkpoint manifest in ``location`` was written (``ddpjob status``'s checkpoint age), None
    without one; an unreachable store is a warning. No torch: status reads a thousand trials."""
    storage = at(location)
    try:
        names = [name for name in storage.names() if MANIFEST.match(name)]
        return max(storage.modified(name) for name in names) if names else None
    except Exception as err:  # an unreachable store or bad credentials: one run's age unknown, status goes on
        log.warning("checkpoints in %s: %s: %s", storage.where, type(err).__name__, err)
        return None


_PROBE_HINT = (
    "check the bucket's name, and the credentials and endpoint the AWS tools read (AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role; AWS_ENDPOINT_URL for a non-AWS server): "
    "`aws s3 ls BUCKET` must work here and on the nodes"
)


@cache
def probe(url: str) -> None:
    """The login node's check of ``checkpoint.dir`` = ``url`` (once per URL per process: a sweep's trials share
    it): the filesystem is installed, the bucket exists, and a test object can be written and deleted. Raises
    ``DdpJobError`` naming the key, one line, with the cause (never a credential: none is in the URL)."""
    key = f"config key 'checkpoint.dir' = {url!r}"
    try:
        storage = ObjectStorage(url)
    except ImportError as err:
        raise DdpJobError(
            f"{key}: no filesystem for this URL here ({err})",
            "pip install 'ddpjob[s3]' (s3fs) for s3:// URLs, or the fsspec package of your store",
        ) from None
    except (ValueError, TypeError) as err:
        raise DdpJobError(f"{key} is not a storage URL ({err})", "e.g. s3://BUCKET/PREFIX") from None
    bucket = storage.root.split("/", 1)[0]
    test = f".ddpjob-probe-{secrets.token_hex(4)}"
    try:
        storage.write_text(test, "ddpjob: a test object, deleted at once\n")
        storage.remove(test)
    except FileNotFoundError:
        raise DdpJobError(f"{key}: the bucket {bucket!r} does not exist (or is not visible)", _PROBE_HINT) from None
    except Exception as err:  # botocore's errors (credentials, access, endpoint) are not OSErrors: any failure is one
        cause = " ".join(str(err).split())[:300]
        raise DdpJobError(
            f"{key}: a test object could not be written and deleted ({type(err).__name__}: {cause})", _PROBE_HINT
        ) from None


@contextlib.contextmanager
def local_copy(storage: Storage, name: str) -> Iterator[Path]:
    """A local folder holding entry ``name``'s files: the folder itself for local storage, else a download into a
    private temporary folder of this user's (``ddp_core.run.private``; removed after)."""
    if isinstance(storage, LocalStorage):
        yield storage.root / name
        return
    with privately.temporary("download") as scratch:
        storage.download_folder(name, scratch / name)
        privately.seal(scratch)
        yield scratch / name
