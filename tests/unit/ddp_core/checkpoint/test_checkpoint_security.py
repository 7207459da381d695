"""A tampered sharded checkpoint must not run code: not on `ddpjob export`, not on a trainer resume (both load through
one check, ``ddp_core.checkpoint.sharded.read_metadata``: each payload is shown to export, one to the trainer too).

Both payloads are real (each test first shows that the unguarded path runs it), and the attacker is assumed
to rewrite the manifest too: a sha256 proves integrity, not authorship.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_core.checkpoint.store import files_digest, sha256_file
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT, run_trainer

CHARLM = str(ROOT / "configs" / "charlm.yaml")
SMALL = ["strategy.name=fsdp", "wandb.mode=disabled", "task.data.max_chars=40000", "task.model.d_model=16",
         "data.batch_size=4", "train.eval_every=0", "optim.warmup_steps=0", "checkpoint.every_steps=2"]  # fmt: skip


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sec") / "run"
    run_trainer(CHARLM, run, [*SMALL, "train.max_steps=2"])
    return run


def _fresh_copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run, and its checkpoint folder."""
    subprocess.run(["cp", "-a", str(run), str(tmp_path / "run")], check=True)
    folder = tmp_path / "run" / "checkpoints" / "step_00000002.dcp"
    assert folder.is_dir()
    return tmp_path / "run", folder


def _rewrite_manifest(folder: Path) -> None:
    """What an attacker with write access does after tampering: make the manifest match again."""
    manifest = folder.with_suffix(".json")
    meta = json.loads(manifest.read_text())
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(folder.iterdir())}
    meta.update(files=files, sha256=files_digest(files), size=sum(f["size"] for f in files.values()))
    manifest.write_text(json.dumps(meta))


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _dotted_name_payload(command: str) -> bytes:
    # Protocol 4: STACK_GLOBAL resolves 'torch.os.system' inside the DCP metadata module by attribute walk.
    return (
        b"\x80\x04" + _short("torch.distributed.checkpoint.metadata") + _short("torch.os.system") + b"\x93"
        + _short(command) + b"\x85" + b"R" + b"."
    )  # fmt: skip


class _Payload:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _refuses(run: Path, marker: Path, why: str, resume: bool) -> None:
    """``ddpjob export`` refuses the checkpoint in one line; ``resume``: so does the trainer's resume (a whole trainer
    start, ~30 CPU-s: once, for one payload; both paths load through the same check, ``sharded.read_metadata``)."""
    export = run_cli("export", str(run), str(run.parent / "model.pt"), cwd=run.parent)
    assert export.returncode == 2, export.stdout + export.stderr
    lines = export.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoint" in lines[0] and "refused: " + why in lines[0], export.stderr
    if resume:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
        # no time bound of its own beyond a stuck one's: under CI's load a trainer's start took over 120 s
        done = subprocess.run([sys.executable, "-m", "ddp_core", str(run)], capture_output=True, text=True,
                              timeout=600, env=env | {"OMP_NUM_THREADS": "1"})  # fmt: skip
        assert done.returncode != 0
        assert "CheckpointRefused: checkpoint " in done.stderr and "refused: " + why in done.stderr, done.stderr
    assert not marker.exists(), "the payload ran"


def test_dotted_name_in_metadata_is_refused(sharded_run, tmp_path):
    run, folder = _fresh_copy(sharded_run, tmp_path)
    live = tmp_path / "live"
    subprocess.run([sys.executable, "-c", "import pickle,sys; pickle.loads(sys.stdin.buffer.read())"],
                   input=_dotted_name_payload(f"touch {live}"), check=False)  # fmt: skip
    assert live.exists()  # the payload is real: plain unpickling runs it

    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(_dotted_name_payload(f"touch {marker}"))
    _rewrite_manifest(folder)
    _refuses(run, marker, "its .metadata names 'torch.distributed.checkpoint.metadata.torch.os.system'", resume=False)


def test_bytes_entry_is_refused(sharded_run, tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    run, folder = _fresh_copy(sharded_run, tmp_path)
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own trusted read
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))

    def plant(command: str) -> None:
        payload = tmp_path / "payload.pt"
        torch.save(_Payload(command), payload)
        (folder / "evil.distcp").write_bytes(payload.read_bytes())
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != key} | {
            MetadataIndex(key): _StorageInfo(Path("evil.distcp"), 0, payload.stat().st_size)
        }
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        _rewrite_manifest(folder)

    live = tmp_path / "live"
    plant(f"touch {live}")
    unguarded = (
        "import torch, torch.distributed.checkpoint as dcp, sys;"
        f"dcp.load({{'model': {{{key.removeprefix('model.')!r}: torch.empty(1)}}}},"
        f" storage_reader=dcp.FileSystemReader({str(folder)!r}), no_dist=True)"
    )
    subprocess.run([sys.executable, "-c", unguarded], capture_output=True, check=False, cwd=ROOT)
    assert live.exists()  # the payload is real: DCP's own reader unpickles bytes entries with weights_only=False

    marker = tmp_path / "ran"
    plant(f"touch {marker}")
    _refuses(run, marker, "it declares a non-tensor (bytes) entry", resume=True)
