"""Full checkpoints written in the background (``checkpoint.async_save``), and the checksums of their manifests."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_core.checkpoint import full as full_checkpoint
from ddp_core.checkpoint import staging
from ddp_core.checkpoint import store as checkpoint
from ddp_core.checkpoint.full import CheckpointWriteError, FullWriter
from ddp_core.errors import DdpJobError
from tests.support.helpers import ROOT


def trained_state(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """A model and AdamW after one step, and their state as the trainer saves it (tensors shared with them)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "position": {"step": 1, "epoch": 0},
             "rng": [torch.get_rng_state()], "log_loss": torch.tensor([1.5, 2.0], dtype=torch.float64)}  # fmt: skip
    return model, optimizer, state


def train_on(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()


def test_async_save_writes_the_bytes_a_sync_save_writes_while_training_goes_on(tmp_path):
    model, optimizer, state = trained_state()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    sync = FullWriter(tmp_path / "sync", keep_last=3, async_save=False)
    background = FullWriter(tmp_path / "async", keep_last=3, async_save=True)
    sync.save(1, state)
    background.save(1, state)
    for _ in range(3):  # training changes the live tensors (in place) while the file is written
        train_on(model, optimizer)
    state["position"]["step"] = 4  # and the plain values
    background.close()
    a, b = checkpoint.find_latest(tmp_path / "sync"), checkpoint.find_latest(tmp_path / "async")
    assert a is not None and b is not None and (a.step, b.step) == (1, 1)
    assert a.path.read_bytes() == b.path.read_bytes() and a.digest == b.digest
    loaded = checkpoint.load(b)
    assert loaded["position"] == {"step": 1, "epoch": 0}
    assert all(torch.equal(loaded["model"][k], expected[k]) for k in expected)
    manifest = json.loads(b.path.with_suffix(".json").read_text())
    assert manifest["checksum"] == "xxh3_128" and manifest["digest"] == b.digest and "sha256" not in manifest


def test_staging_buffers_are_reused_and_copies_stay_independent(tmp_path):
    model, optimizer, state = trained_state()
    stage = staging.Staging()
    first = stage.copy(state)
    weight = first["model"]["0.weight"].clone()
    train_on(model, optimizer)
    second = stage.copy(state)
    assert second["model"]["0.weight"].data_ptr() == first["model"]["0.weight"].data_ptr()  # the same buffer
    assert torch.equal(second["model"]["0.weight"], model.state_dict()["0.weight"])
    assert not torch.equal(second["model"]["0.weight"], weight)
    base = torch.arange(6.0)
    views = stage.copy({"a": base[1:4], "b": base, "c": base[::2]})
    assert views["a"].untyped_storage().data_ptr() == views["b"].untyped_storage().data_ptr()  # shared, as saved
    assert views["c"].stride() == (2,) and torch.equal(views["c"], base[::2])


def test_an_async_save_copies_the_optimizers_tensors_while_the_next_forward_and_backward_run(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_on(model, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    release = threading.Event()
    real_copy_all = staging._copy_all

    def held_copy_all(pieces):  # the copies left for later, held until the forward and backward are done
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(30)
        real_copy_all(pieces)

    # The held copy is released only once the optimizer's step is in the fence: if the step did not wait for the copy,
    # its update would run before the release (no timing involved).
    fencing, real_fence = threading.Event(), staging.Copying.fence

    def fence(self):
        fencing.set()
        real_fence(self)

    monkeypatch.setattr(staging, "_copy_all", held_copy_all)
    monkeypatch.setattr(staging.Copying, "fence", fence)
    writer = FullWriter(tmp_path, keep_last=3, async_save=True, optimizer=optimizer)
    released_before_update = []
    optimizer.register_step_pre_hook(lambda *_: released_before_update.append(release.is_set()))  # after the fence's
    writer.save(1, state)
    model(torch.randn(4, 32)).sum().backward()  # changes the batch-norm statistics: copied before save returned
    threading.Thread(target=lambda: fencing.wait(30) and release.set(), daemon=True).start()
    optimizer.step()  # waits for the copy, then changes parameters and moments
    assert released_before_update == [True] and writer.fence_s > 0  # the step waited for the held copy
    writer.close()
    loaded = checkpoint.load(checkpoint.find_latest(tmp_path))
    assert all(torch.equal(loaded["model"][k], expected[k]) for k in expected)
    assert not torch.equal(model[1].running_mean, expected["1.running_mean"])
    saved = [loaded["optimizer"]["state"][i]["exp_avg"] for i in range(len(moments))]
    assert all(torch.equal(a, b) for a, b in zip(saved, moments, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a GPU node: the side-stream copy)")
def test_an_async_save_of_gpu_tensors_holds_the_state_at_the_save_while_training_goes_on(tmp_path):
    """On a GPU: buffers copied on the training stream, parameters and moments on a side stream during the next
    forward and backward, the optimizer's step queued after them; no host sync in the save."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 256)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    batch = torch.randn(64, 256, device="cuda")
    model(batch).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    moments = [optimizer.state[p]["exp_avg"].cpu() for p in model.parameters()]
    writer = FullWriter(tmp_path, keep_last=3, async_save=True, optimizer=optimizer)
    writer.save(1, state)
    for _ in range(3):
        model(batch).sum().backward()
        optimizer.step()
    writer.close()
    loaded = checkpoint.load(checkpoint.find_latest(tmp_path))
    assert all(torch.equal(loaded["model"][k], expected[k]) for k in expected)
    saved = [loaded["optimizer"]["state"][i]["exp_avg"] for i in range(len(moments))]
    assert all(torch.equal(a, b) for a, b in zip(saved, moments, strict=True))
    assert not torch.equal(model[0].weight.cpu(), expected["0.weight"])


def test_a_second_save_waits_for_the_first(tmp_path, monkeypatch):
    release, order = threading.Event(), []
    real_save = checkpoint.save

    def slow_save(directory, step, state, *args, **kwargs):
        if step == 1:
            assert release.wait(30)
        info = real_save(directory, step, state, *args, **kwargs)
        order.append(step)
        return info

    monkeypatch.setattr(full_checkpoint.checkpoint, "save", slow_save)
    _, _, state = trained_state()
    writer = FullWriter(tmp_path, keep_last=3, async_save=True)
    assert writer.save(1, state) < 5  # returned while step 1 is held in the background
    second = threading.Thread(target=writer.save, args=(2, state))
    second.start()
    second.join(0.5)
    assert second.is_alive() and order == []  # step 2 waits for step 1
    release.set()
    second.join(30)
    writer.close()
    assert order == [1, 2] and [p.name for p in sorted(tmp_path.glob("*.json"))] == [
        "step_00000001.json", "step_00000002.json",
    ]  # fmt: skip


def test_a_background_failure_is_logged_and_raised_at_the_next_wait(tmp_path, caplog):
    _, _, state = trained_state()
    directory = tmp_path / "checkpoints"
    writer = FullWriter(directory, keep_last=3, async_save=True)
    directory.write_text("a file where the folder should be")  # the write fails as a lost mount would
    with caplog.at_level(logging.ERROR):
        writer.save(1, state)  # returns: the failure happens in the background
        writer._pending.exception(timeout=30)  # type: ignore[union-attr]
    assert "the checkpoint of step 1 failed in the background" in caplog.text
    with pytest.raises(CheckpointWriteError, match=r"checkpoint of step 1 failed in the background: FileExistsError"):
        writer.save(2, state)
    directory.unlink()
    writer.save(3, state)  # raised once; the writer works again
    writer.close()
    assert checkpoint.find_latest(directory).step == 3


def test_a_signal_save_is_complete_when_it_returns(tmp_path):
    _, _, state = trained_state()
    writer = FullWriter(tmp_path, keep_last=3, async_save=True)
    writer.save(1, state)
    writer.save(2, state, sync=True)  # waits for step 1, then writes step 2 in this thread
    assert writer._pending is None and checkpoint.find(tmp_path, 1) and checkpoint.find(tmp_path, 2)
    assert writer.last_write_s is not None and writer.last_write_s > 0


def test_a_sync_save_returns_before_its_prune_which_never_removes_the_best(tmp_path, monkeypatch):
    hold, release, held = threading.Event(), threading.Event(), threading.Event()
    real_prune = checkpoint.prune

    def held_prune(directory, keep_last):
        if hold.is_set():
            held.set()
            assert release.wait(30)
        real_prune(directory, keep_last)

    monkeypatch.setattr(full_checkpoint.checkpoint, "prune", held_prune)
    _, _, state = trained_state()
    writer = FullWriter(tmp_path, keep_last=1, async_save=False)
    writer.save(1, state)
    checkpoint.mark_best(tmp_path, 1, "min:eval/loss", 0.5)
    hold.set()
    writer.save(2, state, sync=True)
    assert held.wait(30)
    second = threading.Thread(target=writer.save, args=(3, state))
    second.start()
    second.join(0.5)
    # Step 2 returned complete while its prune was held; step 3 waits for that prune before it writes.
    assert second.is_alive() and checkpoint.find(tmp_path, 2) and not checkpoint.find(tmp_path, 3)
    assert checkpoint.find(tmp_path, 1)
    release.set()
    second.join(30)
    writer.close()  # waits for step 3's prune
    assert [p.name for p in sorted(tmp_path.glob("step_*"))] == [
        "step_00000001.json", "step_00000001.pt", "step_00000003.json", "step_00000003.pt",
    ]  # fmt: skip


KILLED_CHILD = """
import sys, time, torch
from pathlib import Path
from ddp_core.checkpoint.full import FullWriter
writer = FullWriter(Path(sys.argv[1]), keep_last=5, async_save=True)
writer.save(1, {"w": torch.zeros(4)})
writer.wait()
big = {"model": {f"w{i}": torch.randn(16, 1 << 20) for i in range(6)}}  # 384 MiB
writer.save(2, big)
print("saved", flush=True)  # training goes on while the background thread writes
time.sleep(120)
"""


def _half_written(directory: Path) -> bool:
    """Step 2's file holds some data but less than half of it: mid-write, not about to finish."""
    for path in directory.glob(".step_00000002.pt.tmp*"):
        try:
            return 1 << 20 < path.stat().st_size < 192 << 20
        except FileNotFoundError:  # renamed meanwhile
            return False
    return False


def test_kill_9_during_a_background_write_leaves_no_checkpoint_that_looks_complete(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "saved\n"
        deadline = time.monotonic() + 60
        while not _half_written(tmp_path) and time.monotonic() < deadline:
            pass
        assert _half_written(tmp_path), sorted(p.name for p in tmp_path.iterdir())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "step_00000002.json").exists()
    latest = checkpoint.find_latest(tmp_path)
    assert latest is not None and latest.step == 1
    assert checkpoint.find(tmp_path, 2) is None
    # The next save (a resumed attempt's) prunes the half-written file.
    checkpoint.save(tmp_path, 3, {"w": torch.ones(4)}, keep_last=5)
    assert not list(tmp_path.glob(".*tmp*"))


def _old_sha256_checkpoint(directory: Path, step: int, state: dict) -> Path:
    """A full checkpoint as ddpjob wrote it before manifests named their checksum: a ``sha256`` field."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"step_{step:08d}.pt"
    torch.save(state, data)
    manifest = {"step": step, "kind": "full", "file": data.name, "sha256": checkpoint.sha256_file(data),
                "size": data.stat().st_size, "time": 0.0, "writer": {"rank": 0, "host": "h", "pid": 1}}  # fmt: skip
    data.with_suffix(".json").write_text(json.dumps(manifest, indent=1) + "\n")
    return data


def test_old_sha256_manifests_still_load_and_are_still_checked(tmp_path, caplog):
    _, _, state = trained_state()
    _old_sha256_checkpoint(tmp_path, 1, state)
    old = _old_sha256_checkpoint(tmp_path, 2, state)
    info = checkpoint.find_latest(tmp_path)
    assert info is not None and info.step == 2 and info.digest == checkpoint.sha256_file(old)
    assert torch.equal(checkpoint.load(info)["model"]["0.weight"], state["model"]["0.weight"])
    data = bytearray(old.read_bytes())
    data[len(data) // 2] ^= 0xFF
    old.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(tmp_path).step == 1
    assert "sha256 mismatch (corrupt)" in caplog.text
    checkpoint.save(tmp_path, 3, state, keep_last=5)  # new ones next to old ones: each checked its own way
    assert checkpoint.find_latest(tmp_path).step == 3


@pytest.mark.parametrize(
    ("fields", "why"),
    [({"checksum": "md5", "digest": "x"}, "names the checksum 'md5'"), ({"checksum": "xxh3_128"}, "digest is missing")],
    ids=["unknown", "no_digest"],
)
def test_a_manifest_with_an_unknown_or_missing_checksum_is_skipped(tmp_path, caplog, fields, why):
    checkpoint.save(tmp_path, 1, {"w": torch.zeros(2)}, keep_last=3)
    checkpoint.save(tmp_path, 2, {"w": torch.ones(2)}, keep_last=3)
    manifest = tmp_path / "step_00000002.json"
    meta = {k: v for k, v in json.loads(manifest.read_text()).items() if k not in ("checksum", "digest")}
    manifest.write_text(json.dumps(meta | fields))
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(tmp_path).step == 1
    assert why in caplog.text


def test_without_xxhash_saves_use_sha256_and_xxh3_manifests_are_an_error_not_skipped(tmp_path, monkeypatch):
    checkpoint.save(tmp_path / "new", 1, {"w": torch.zeros(2)}, keep_last=3)
    monkeypatch.setattr(checkpoint, "_CHECKSUMS", {"sha256": checkpoint._CHECKSUMS["sha256"]})
    monkeypatch.setattr(checkpoint, "CHECKSUM", "sha256")
    with pytest.raises(DdpJobError, match="checksummed with xxh3_128, and the Python package xxhash is not installed"):
        checkpoint.find_latest(tmp_path / "new")  # not skipped: the run would restart from scratch
    info = checkpoint.save(tmp_path / "plain", 1, {"w": torch.zeros(2)}, keep_last=3)
    assert json.loads(info.path.with_suffix(".json").read_text())["checksum"] == "sha256"
    assert checkpoint.find_latest(tmp_path / "plain") == info
