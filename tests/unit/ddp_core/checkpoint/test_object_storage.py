"""Checkpoints in object storage (checkpoint.dir = s3://...), against a real S3 server on loopback (moto's server
mode, tests/support/s3.py): the same format as on disk, parts first and the manifest last, without renames."""

import logging
import signal

import pytest
import s3fs
import torch

from ddp_core.checkpoint import storage
from ddp_core.checkpoint import store as checkpoint
from ddp_core.checkpoint.full import FullWriter
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from tests.support import s3 as s3_support
from tests.support.s3 import SECRET_KEY

s3_server, s3 = s3_support.s3_server, s3_support.s3  # the fixtures


def state(step, n=4):
    return {"model": {"w": torch.arange(n, dtype=torch.float32) + step}, "position": {"step": step}}


def objects(url):
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    prefix = url.removeprefix("s3://")
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix)) if fs.exists(prefix) else []


def test_save_find_load_round_trip_and_prune_keep_last(s3):
    url = s3.url()
    for step in (10, 20, 30):
        info = checkpoint.save(url, step, state(step), keep_last=2)
        assert info.path == f"{url}/step_{step:08d}.pt" and info.name == f"step_{step:08d}.pt"
    assert objects(url) == ["step_00000020.json", "step_00000020.pt", "step_00000030.json", "step_00000030.pt"]
    latest = checkpoint.find_latest(url)
    assert latest == info
    assert torch.equal(checkpoint.load(latest)["model"]["w"], state(30)["model"]["w"])
    assert checkpoint.steps(url) == [20, 30] and checkpoint.find(url, 20).step == 20
    assert checkpoint.find(url, 10) is None


def test_best_is_kept_apart_from_keep_last(s3):
    url = s3.url("best")
    checkpoint.save(url, 1, state(1), keep_last=1)
    checkpoint.mark_best(url, 1, "eval/loss", 0.5)
    for step in (2, 3):
        checkpoint.save(url, step, state(step), keep_last=1)
    assert checkpoint.best_step(url) == 1 and checkpoint.find_best(url).step == 1
    assert checkpoint.steps(url) == [1, 3]


def test_a_manifest_whose_part_is_missing_or_corrupt_is_skipped(s3, caplog):
    url = s3.url("integrity")
    fs = s3fs.S3FileSystem()
    checkpoint.save(url, 1, state(1), keep_last=5)
    second = checkpoint.save(url, 2, state(2), keep_last=5)
    third = checkpoint.save(url, 3, state(3), keep_last=5)
    fs.rm(str(third.path).removeprefix("s3://"))  # a part gone: its manifest vouches for nothing
    data = bytearray(fs.cat_file(str(second.path).removeprefix("s3://")))
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    fs.pipe_file(str(second.path).removeprefix("s3://"), bytes(data))
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(url).step == 1
    assert "missing data" in caplog.text and "mismatch (corrupt)" in caplog.text
    # Data whose manifest never came (a killed save) is pruned by a later save, once older than the newest.
    fs.pipe_file(f"{url.removeprefix('s3://')}/step_00000004.pt", b"half")
    checkpoint.save(url, 5, state(5), keep_last=5)
    assert "step_00000004.pt" not in objects(url)


def test_async_full_writer_uploads_in_the_background(s3):
    url = s3.url("async")
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    writer = FullWriter(url, keep_last=2, async_save=True, optimizer=optimizer)
    try:
        whole = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        writer.save(7, whole)
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()  # waits for the copy of what it changes; the upload goes on
        writer.wait()
    finally:
        writer.close()
    loaded = checkpoint.load(checkpoint.find_latest(url))
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())


KILLED_CHILD = """
import sys, torch
from ddp_core.checkpoint import store
url = sys.argv[1]
store.save(url, 1, {"w": torch.ones(4)}, keep_last=5)
print("saved", flush=True)
store.save(url, 2, {"w": torch.ones(96 << 20)}, keep_last=5)  # 384 MB: parts of 64 MiB, uploaded one by one
print("finished", flush=True)
"""


def test_kill_9_during_an_upload_leaves_the_earlier_checkpoint(s3):
    url = s3.url("killed")
    s3_support.killed_while_uploading(s3.bucket, url, KILLED_CHILD, "step_00000002.pt")
    assert objects(url) == ["step_00000001.json", "step_00000001.pt"]  # the half upload is not an object
    latest = checkpoint.find_latest(url)
    assert latest is not None and latest.step == 1


def test_probe_checks_the_bucket_and_says_which_key(s3, monkeypatch):
    storage.probe(s3.url("probe"))
    assert objects(s3.url("probe")) == []  # the test object is deleted
    with pytest.raises(DdpJobError, match=r"^config key 'checkpoint.dir' = 's3://no-such-bucket-x/p': the bucket"):
        storage.probe("s3://no-such-bucket-x/p")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # no credentials anywhere
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(DdpJobError) as err:
        storage.probe(s3.url("other"))
    assert "checkpoint.dir" in err.value.message and "\n" not in err.value.message, err.value.message
    assert SECRET_KEY not in str(err.value)


def test_a_run_resumes_from_s3_at_another_world_size_bitwise(s3, tmp_path):
    """train.invariant, checkpoints in S3: 2 ranks under torchrun stop on the warning signal during step 5 (saved in S3
    after step 6), and 1 rank resumes from there, ending on the digest of an uninterrupted run (one rank, on disk)."""
    from tests.support.continuation import Setup
    from tests.support.digits import DIGITS
    from tests.support.helpers import events, final_digests, run_trainer

    common = [*Setup(1, 1, False, True).overrides(), "train.max_steps=12", "train.eval_every=0"]
    ref = final_digests(run_trainer(DIGITS, tmp_path / "ref", common, 1, torchrun=True))
    run, in_s3 = tmp_path / "run", [*common, f"checkpoint.dir={s3.url()}"]
    run_trainer(DIGITS, run, in_s3, 2, {"DDPJOB_TEST_INTERRUPT": "signal:1:9"}, stopped=True)  # 2 forwards a step
    assert events(run, "interrupted")[-1]["step"] == 6 and not list((run / "checkpoints").iterdir())
    saved = [p.rsplit("/", 1)[-1] for p in s3fs.S3FileSystem().find(s3.url().removeprefix("s3://"))]
    assert "step_00000006.json" in saved, saved
    log = run_trainer(DIGITS, run, in_s3, 1, torchrun=True)
    assert "resumed from step_00000006.pt" in log and final_digests(log) == ref, log[-3000:]


def test_a_stalled_upload_at_the_warning_signal_is_left_and_the_run_resumes_before_it(tmp_path, monkeypatch):
    """Background saves to S3 whose server stops answering (SIGSTOP from inside the rank, at a chosen step): the
    warning signal's stop waits for the upload in flight only while slurm.signal_lead_s lasts, then ends the attempt
    without it; the checkpoint before it is complete, and the run resumes from it, bitwise."""
    from tests.support.continuation import Setup
    from tests.support.digits import DIGITS
    from tests.support.helpers import events, final_digests, run_trainer, stop_server

    proc, endpoint = s3_support.start_server(tmp_path / "moto.log")  # this test's own: it is stopped mid-test
    try:
        server = s3_support.S3(endpoint, "stalled")
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(server.bucket)
        common = [*Setup(1, 1, True, False).overrides(), "train.max_steps=12", "train.eval_every=0"]
        ref = final_digests(run_trainer(DIGITS, tmp_path / "ref", common, 1))
        run, in_s3 = tmp_path / "run", [*common, f"checkpoint.dir={server.url()}", "slurm.signal_lead_s=8"]
        run_trainer(DIGITS, run, in_s3, 1, {"DDPJOB_TEST_INTERRUPT": "signal:0:4"}, stopped=True)
        assert events(run, "interrupted")[-1]["step"] == 4
        # Resumed at step 4: the server stops at step 5 (nothing in flight); step 8's upload stalls; the signal
        # during step 10 stops the attempt after it.
        stall = {"DDPJOB_TEST_STALL": f"{proc.pid}:1", "DDPJOB_TEST_INTERRUPT": "signal:0:6"}
        # The attempt ends while the server is still stopped (it is continued only below): the stop left the upload.
        # No wall-clock bound: under load this process's start alone took 34 s once (run_trainer's timeout is the
        # backstop for a stop that waited).
        log = run_trainer(DIGITS, run, in_s3, 1, stall, stopped=True)
        assert "did not complete within 3 s of the signal" in log, log[-3000:]
        assert events(run, "interrupted")[-1]["step"] == 10
        proc.send_signal(signal.SIGCONT)
        assert checkpoint.steps(RunDir(run).recorded_checkpoints()) == [4]  # step 8: parts at most, no manifest
        log = run_trainer(DIGITS, run, in_s3, 1)
        assert "resumed from step_00000004.pt" in log and final_digests(log) == ref, log[-3000:]
    finally:
        proc.send_signal(signal.SIGCONT)
        stop_server(proc)
