"""Saving a step that is there already (an attempt resumed at its last step saves it again): the new copy is written
beside the one the manifest vouches for and the manifest is swapped in one write, so a failure at any point of the
re-save leaves a complete, verified copy of the step. Failures are real: a small tmpfs filled up, a real S3 server
(moto's, tests/support/s3.py) with its writer killed mid-upload."""

import errno
import os
import shutil

import pytest
import s3fs
import torch

from ddp_core.checkpoint import store
from ddp_core.run.diskfull import disk_error
from tests.support import s3 as s3_support
from tests.support.filesystems import fill, pages, small_tmpfs

s3_server, s3 = s3_support.s3_server, s3_support.s3  # the fixtures


def state(value, n=1 << 18):  # 1 MiB of weights
    return {"model": {"w": torch.full((n,), float(value))}, "position": {"step": 10}}


def weight(info):
    return float(store.load(info)["model"]["w"][0])


def objects(url):
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://")))


def test_a_resave_goes_beside_and_swaps_and_the_names_alternate(tmp_path):
    first = store.save(tmp_path, 10, state(1), keep_last=1)
    second = store.save(tmp_path, 10, state(2), keep_last=1)
    assert second.name == "step_00000010.1.pt" and store.find_latest(tmp_path) == second and weight(second) == 2
    assert sorted(os.listdir(tmp_path)) == ["step_00000010.1.pt", "step_00000010.json"]
    third = store.save(tmp_path, 10, state(3), keep_last=1)
    assert third.name == first.name and weight(store.find_latest(tmp_path)) == 3
    assert sorted(os.listdir(tmp_path)) == ["step_00000010.json", "step_00000010.pt"]
    # Killed between the new manifest and the removal of the copy it replaced: both names are there; the next prune
    # removes the one no manifest vouches for. A later step prunes both names of an old one.
    shutil.copy(tmp_path / "step_00000010.pt", tmp_path / "step_00000010.1.pt")
    store.prune(tmp_path, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["step_00000010.json", "step_00000010.pt"]
    store.save(tmp_path, 10, state(4), keep_last=2)
    store.save(tmp_path, 20, state(5), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["step_00000020.json", "step_00000020.pt"]


def test_a_resave_that_runs_out_of_space_for_its_data_keeps_the_step(tmp_path):
    with small_tmpfs(tmp_path / "fs", 4 << 20) as folder:
        first = store.save(folder, 10, state(1), keep_last=1)
        fill(folder, leave=first.size // 2)  # the second copy cannot fit beside the first
        with pytest.raises(Exception) as err:
            store.save(folder, 10, state(2), keep_last=1)
        assert disk_error(err.value).errno == errno.ENOSPC  # torch.save raises a RuntimeError from it
        assert store.find_latest(folder) == first and weight(first) == 1
        assert sorted(os.listdir(folder)) == [".filler", "step_00000010.json", "step_00000010.pt"]


def test_a_resave_that_runs_out_of_space_for_its_manifest_keeps_the_step(tmp_path):
    with small_tmpfs(tmp_path / "fs", 4 << 20) as folder:
        first = store.save(folder, 10, state(1), keep_last=1)
        fill(folder, leave=pages(first.size))  # room for the data, not one page more: the manifest fails
        with pytest.raises(OSError) as err:
            store.save(folder, 10, state(2), keep_last=1)
        assert err.value.errno == errno.ENOSPC
        assert store.find_latest(folder) == first and weight(first) == 1
        # The new copy is gone too: a full disk gets its space back.
        assert sorted(os.listdir(folder)) == [".filler", "step_00000010.json", "step_00000010.pt"]


def test_a_failed_resave_in_s3_keeps_the_step(s3):
    url = s3.url("failed")
    first = store.save(url, 10, state(1), keep_last=1)
    with pytest.raises(Exception, match="pickle"):  # torch.save fails mid-stream: the upload is aborted
        store.save(url, 10, state(2) | {"bad": lambda: 0}, keep_last=1)
    assert store.find_latest(url) == first and weight(first) == 1
    assert objects(url) == ["step_00000010.json", "step_00000010.pt"]
    second = store.save(url, 10, state(2), keep_last=1)
    assert second.name == "step_00000010.1.pt" and weight(store.find_latest(url)) == 2
    assert objects(url) == ["step_00000010.1.pt", "step_00000010.json"]


KILLED_CHILD = """
import sys, torch
from ddp_core.checkpoint import store
from ddp_core.run.diskfull import disk_error
url = sys.argv[1]
store.save(url, 10, {"w": torch.ones(4)}, keep_last=1)
print("saved", flush=True)
store.save(url, 10, {"w": torch.ones(24 << 20)}, keep_last=1)  # 96 MB: a multipart upload, its first part 64 MiB
print("finished", flush=True)
"""


def test_kill_9_during_a_resave_upload_keeps_the_step(s3):
    url = s3.url("killed")
    s3_support.killed_while_uploading(s3.bucket, url, KILLED_CHILD, "step_00000010.1.pt")
    assert objects(url) == ["step_00000010.json", "step_00000010.pt"]  # the half upload is not an object
    latest = store.find_latest(url)
    assert latest is not None and latest.step == 10 and torch.equal(store.load(latest)["w"], torch.ones(4))
