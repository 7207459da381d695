"""The node-local tier on a node other users share (issue 55), with a real second user (``ddpjob-mallory``,
tests/support/users.py) attacking root's run: a folder she made first in the tier's predictable place (0777, 0755,
a symlink, one holding a forged copy) is refused and the run goes on with its durable checkpoints; she can neither
read root's copies nor swap them; a node folder that stops passing the check is never restored from; and a full
``local_path`` (a real 4 MiB tmpfs) skips copies instead of failing the run, until there is room again."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from ddp_core.checkpoint import local_restore
from ddp_core.checkpoint.manager import Restored
from ddp_core.run import private
from ddp_core.run.rundir import RunDir
from tests.support import users
from tests.support.local_tier import node_folder, rig, train

JOB = "77"


@pytest.fixture
def shm():
    """A folder like /dev/shm that both users may write (mode 1777: sticky, as /dev/shm)."""
    users.require_root()
    folder = Path(tempfile.mkdtemp(prefix="ddpjob-test-shm-", dir="/tmp"))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def mallory():
    return users.ensure("mallory")


def job_folder(shm: Path) -> Path:
    return shm / private.per_user_name(JOB)


def plant(mallory: users.User, shm: Path, how: str) -> None:
    """Mallory makes the tier's folder of root's job first, as she can: only its name is needed (squeue)."""
    target = job_folder(shm)
    script = {
        "0777": f"mkdir -m 0777 {target}",
        "0755": f"mkdir -m 0755 {target}",
        "symlink": f"mkdir -m 0777 {shm}/hers && ln -s {shm}/hers {target}",
    }[how]
    users.shell(mallory, script, check=True)


@pytest.mark.parametrize("how", ["0777", "0755", "symlink"])
def test_a_folder_another_user_made_first_is_refused_and_the_run_goes_on_durably(tmp_path, shm, mallory, how, caplog):
    plant(mallory, shm, how)
    with caplog.at_level(logging.WARNING):
        a = rig(tmp_path, local_path=str(shm), every_steps=4)
    assert a.manager.local is None
    line = next(r.getMessage() for r in caplog.records if "node-local tier off" in r.getMessage())
    assert "\n" not in line and str(job_folder(shm)) in line and ": refused" in line
    assert {"0777": "is owned by ddpjob-mallory", "0755": "is owned by ddpjob-mallory", "symlink": "is a symlink"}[
        how
    ] in line
    events = [e for e in RunDir(tmp_path / "run").events() if e["event"] == "local_tier_off"]
    assert len(events) == 1 and str(job_folder(shm)) in events[0]["reason"]
    train(a, 9)  # durable checkpoints at 4 and 8; nothing written in her folder
    a.manager.close()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.json")) == [
        "step_00000004.json",
        "step_00000008.json",
    ]
    assert not list((shm / "hers" if how == "symlink" else job_folder(shm)).iterdir())
    b = rig(tmp_path, seed=1, local_path=str(shm), every_steps=4)
    assert b.manager.load_latest(b.state) == Restored("durable", 8)


def test_a_forged_copy_in_a_folder_she_made_first_is_never_restored(tmp_path, shm, mallory):
    # Her forged copy, with a matching checksum: a real copy of weights she chose, written by the tier itself
    # elsewhere, then moved into the folder she made first and handed to her.
    forger = rig(tmp_path / "forge", local_path=str(tmp_path / "forge" / "shm"), run="run")
    with torch.no_grad():
        for p in forger.model.parameters():
            p.fill_(666.0)
    train(forger, 2)
    forger.manager.close()
    made = node_folder(tmp_path / "forge", JOB)
    (made / "run.txt").write_text(f"{tmp_path / 'run'}\n")  # claims root's run
    shutil.copytree(made.parent, job_folder(shm))
    subprocess.run(["chown", "-R", f"{mallory.name}:", str(job_folder(shm))], check=True)
    subprocess.run(["chmod", "-R", "a+rwX", str(job_folder(shm))], check=True)

    a = rig(tmp_path, local_path=str(shm), every_steps=4)
    assert a.manager.local is None  # refused: her folder
    assert a.manager.load_latest(a.state) is None  # a fresh start, not her step 2
    assert all(float(p.detach().abs().max()) < 100 for p in a.model.parameters())
    a.manager.close()


def test_she_can_neither_read_nor_swap_the_copies_whatever_the_umask(tmp_path, shm, mallory):
    old = os.umask(0)  # the most permissive umask: the modes are ddpjob's own
    try:
        a = rig(tmp_path, local_path=str(shm))
        train(a, 4)
        a.manager.close()
    finally:
        os.umask(old)
    node = node_folder(tmp_path, JOB, local_path=shm)
    assert stat.S_IMODE(job_folder(shm).stat().st_mode) == 0o700
    for path in [node, *node.rglob("*")]:
        assert stat.S_IMODE(path.lstat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    copy = node / "full" / "step_00000004.pt"
    attempts = {
        "read": f"cat {copy}",
        "list": f"ls {job_folder(shm)}",
        "swap": f"mv {job_folder(shm)} {shm}/taken && mkdir -m 0777 {job_folder(shm)}",
        "remove": f"rm -rf {job_folder(shm)}",
        "plant": f"cp /etc/hostname {node}/full/step_00000004.pt",
    }
    for what, script in attempts.items():
        proc = users.shell(mallory, script)
        assert proc.returncode != 0, (what, proc.stdout)
        assert "Permission denied" in proc.stderr or "Operation not permitted" in proc.stderr, (what, proc.stderr)
    b = rig(tmp_path, seed=1, local_path=str(shm))
    assert b.manager.load_latest(b.state) == Restored("local", 4)
    b.manager.close()


def test_a_restore_skips_a_node_folder_that_no_longer_passes_the_check(tmp_path, shm, mallory, caplog):
    a = rig(tmp_path, local_path=str(shm))
    train(a, 4)
    a.manager.close()
    b = rig(tmp_path, seed=1, local_path=str(shm))
    assert b.manager.local is not None
    # Her folder in its place after the check at start (a local_path that is not sticky lets her rename root's).
    os.chown(job_folder(shm), mallory.uid, mallory.gid)
    with caplog.at_level(logging.WARNING):
        assert local_restore.restore(b.manager.local, -1) is None
    assert f"node-local copies skipped: on {socket.gethostname()}, the node-local tier's folder" in caplog.text
    assert "is owned by ddpjob-mallory" in caplog.text
    os.chown(job_folder(shm), 0, 0)
    b.manager.close()


@pytest.fixture
def tmpfs(tmp_path):
    """A real 4 MiB tmpfs as ``checkpoint.local_path``: the tier's room check passes (3 copies of this model and a
    MiB each), and a file filling it leaves no room for the next copy."""
    users.require_root()
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path) -> Path:
    filler = folder / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)  # until ENOSPC
    return filler


def test_a_full_local_path_skips_copies_and_the_run_goes_on_until_there_is_room(tmp_path, tmpfs, caplog):
    a = rig(tmp_path, local_path=str(tmpfs), every_steps=5)
    train(a, 2)  # the copy of step 2, the room checked
    assert a.manager.local is not None
    a.manager.local.collect()  # written
    filler = fill(tmpfs)  # another job fills the node's memory
    with caplog.at_level(logging.WARNING):
        train(a, 6)  # the copies of 4, 6 and 8 fail (ENOSPC); the durable checkpoint of 5 is saved
        a.manager.local.collect()
    assert "failed (ENOSPC): skipped, the run goes on with its durable checkpoints" in caplog.text
    failed = [e for e in RunDir(tmp_path / "run").events() if e["event"] == "local_copy_failed"]
    assert len(failed) == 1 and "No space left on device" in failed[0]["error"]  # once until a copy succeeds
    filler.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train(a, 4)  # the durable checkpoint of 10, the copy of 12
        a.manager.local.collect()
    assert "written again" in caplog.text
    a.manager.close()
    assert (tmp_path / "run" / "checkpoints" / "step_00000010.json").exists()
    b = rig(tmp_path, seed=1, local_path=str(tmpfs), every_steps=5)
    assert b.manager.load_latest(b.state) == Restored("local", 12)
    b.manager.close()


def test_a_local_path_without_room_at_the_first_copy_turns_the_tier_off(tmp_path, tmpfs, caplog):
    a = rig(tmp_path, local_path=str(tmpfs), every_steps=4)
    fill(tmpfs)  # after the folders are claimed, before the first copy
    with caplog.at_level(logging.WARNING):
        train(a, 9)
    assert "node-local tier off for this attempt" in caplog.text and "has 0 MB for the node-local tier" in caplog.text
    assert [e["event"] for e in RunDir(tmp_path / "run").events()] == ["local_tier_off"]
    assert not a.manager.local_due(10, 1000)
    a.manager.close()
    assert (tmp_path / "run" / "checkpoints" / "step_00000008.json").exists()
