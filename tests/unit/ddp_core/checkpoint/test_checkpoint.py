"""Checkpoint files: atomic, verified, keep-last-k, corrupt or incomplete ones skipped."""

import logging

import pytest
import torch

from ddp_core.checkpoint import store as checkpoint


def state(step):
    return {"model": {"w": torch.full((4,), float(step))}, "position": {"step": step}}


def test_save_load_round_trip(tmp_path):
    info = checkpoint.save(tmp_path, 5, state(5), keep_last=3)
    latest = checkpoint.find_latest(tmp_path)
    assert latest == info
    loaded = checkpoint.load(latest)
    assert torch.equal(loaded["model"]["w"], torch.full((4,), 5.0))
    assert not list(tmp_path.glob(".*tmp*"))  # no temp files left


def test_keep_last_k(tmp_path):
    for step in (10, 20, 30, 40, 50):
        checkpoint.save(tmp_path, step, state(step), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000040.json", "step_00000040.pt", "step_00000050.json", "step_00000050.pt",
    ]  # fmt: skip


def test_truncated_newest_is_skipped(tmp_path, caplog):
    checkpoint.save(tmp_path, 1, state(1), keep_last=5)
    newest = checkpoint.save(tmp_path, 2, state(2), keep_last=5)
    data = newest.path.read_bytes()
    newest.path.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING):
        latest = checkpoint.find_latest(tmp_path)
    assert latest is not None and latest.step == 1
    assert "truncated" in caplog.text


def test_corrupt_newest_is_skipped(tmp_path, caplog):
    checkpoint.save(tmp_path, 1, state(1), keep_last=5)
    newest = checkpoint.save(tmp_path, 2, state(2), keep_last=5)
    data = bytearray(newest.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(tmp_path).step == 1
    assert "xxh3_128 mismatch (corrupt)" in caplog.text


def test_data_without_manifest_is_not_a_checkpoint(tmp_path):
    # A kill after the data file was renamed but before the manifest: not complete, not used.
    checkpoint.save(tmp_path, 1, state(1), keep_last=5)
    torch.save(state(2), tmp_path / "step_00000002.pt")
    assert checkpoint.find_latest(tmp_path).step == 1
    assert checkpoint.find_latest(tmp_path / "missing") is None


class Evil:
    pass


def test_loading_refuses_code(tmp_path):
    # weights_only=True: a checkpoint holding an arbitrary object does not load.
    info = checkpoint.save(tmp_path, 1, {"x": Evil()}, keep_last=1)
    try:
        checkpoint.load(info)
    except Exception as err:
        assert "weights_only" in str(err) or "Unsupported" in str(err)
    else:
        raise AssertionError("an arbitrary object loaded with weights_only=True")


def test_atomic_write_leaves_the_old_file_and_no_temp_on_error(tmp_path):
    from ddp_core.run.rundir import atomic_write_text

    path = tmp_path / "run.json"
    atomic_write_text(path, "old\n")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(path, "new \udcff\n")  # fails mid-write, as a full disk would
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


@pytest.mark.parametrize(
    "manifest",
    [
        "null",
        "[]",
        "{}",
        '{"file": "step_00000002.pt", "sha256": "x"}',
        '{"file": "..", "size": 1, "sha256": "x"}',
        '{"file": "../../etc/passwd", "size": 1, "sha256": "x"}',
        '{"kind": "sharded", "file": "step_00000002.dcp", "files": {"../x": {"size": 1, "sha256": "x"}}}',
        "{not json",
    ],
    ids=["null", "list", "empty", "no_size", "dotdot", "path", "sharded_path", "torn"],
)
def test_a_malformed_newest_manifest_is_skipped_with_a_warning(tmp_path, caplog, manifest):
    checkpoint.save(tmp_path, 1, state(1), keep_last=3)
    checkpoint.save(tmp_path, 2, state(2), keep_last=3)
    (tmp_path / "step_00000002.json").write_text(manifest)
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(tmp_path).step == 1
    assert "skipping checkpoint step_00000002.json: unreadable manifest" in caplog.text


@pytest.mark.parametrize("content", ['{"run_id": "ab', "[1, 2]"], ids=["truncated", "list"])
def test_a_corrupt_run_json_is_one_clear_error(tmp_path, content):
    from ddp_core.errors import DdpJobError
    from ddp_core.run.rundir import RunDir

    run = RunDir(tmp_path)
    run.meta_file.write_text(content)
    with pytest.raises(DdpJobError, match=r"run\.json (is unreadable|holds a list)"):
        run.read_meta()
