"""Whether the runs' filesystem takes a flock that holds across nodes (``ddp_core.run.locking``): refused at submit in
one line naming the path, the filesystem and the mount option. This machine's filesystems lock for real; Lustre and
NFS mounts cannot be made here, so their mount table lines (as /proc/self/mountinfo writes them) are read from
text."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from ddp_core.run import locking
from jobs.submission.checks import check_locks
from tests.support.helpers import ROOT


def mountinfo(fstype: str, options: str) -> str:
    """The mount table with one filesystem of ``fstype`` mounted on / (where a path that does not exist leads)."""
    return f"1064 1 0:53 / / rw,relatime shared:1 - {fstype} 10.0.0.1@o2ib:/scratch {options}\n"


@pytest.mark.parametrize(
    ("fstype", "options", "needle"),
    [
        ("lustre", "rw,localflock,lazystatfs", "localflock (a lock holds on its own node only)"),
        ("lustre", "rw,lazystatfs", "no flock option (Lustre refuses flock"),
        ("nfs4", "rw,vers=4.2,local_lock=flock", "local_lock (flock held on each node only)"),
        ("nfs", "rw,vers=3,nolock", "nolock (locks held on each node only)"),
    ],
)
def test_a_filesystem_that_locks_on_each_node_alone_is_named(fstype, options, needle):
    why = locking.problem(Path("/no/such/runs"), mountinfo(fstype, options))
    assert why is not None and why.startswith(f"run.root /no/such/runs is on {fstype} at /, mounted with {needle}")


def test_lustre_with_flock_nfs_with_locks_and_this_machines_filesystems_pass(tmp_path):
    assert locking.problem(Path("/no/such/runs"), mountinfo("lustre", "rw,flock,lazystatfs")) is None
    assert locking.problem(Path("/no/such/runs"), mountinfo("nfs4", "rw,vers=4.2,local_lock=none")) is None
    point, fstype, _ = locking.mount_options(tmp_path)  # the real mount table: a real lock taken in the folder
    assert fstype and Path(point).is_dir()
    assert locking.problem(tmp_path / "runs") is None
    assert not list(tmp_path.iterdir())  # the probe's file is gone


def test_submit_refuses_a_runs_root_that_locks_on_each_node_alone(tmp_path, monkeypatch):
    cfg = load_config(str(ROOT / "configs" / "digits.yaml"), [f"run.root={tmp_path / 'runs'}"])
    check_locks(cfg)  # this machine's filesystem locks: nothing to say
    table = tmp_path / "mountinfo"
    point = locking.mount_point(tmp_path)
    table.write_text(f"1064 1 0:53 / {point} rw,relatime - lustre 10.0.0.1@o2ib:/scratch rw,localflock\n")
    monkeypatch.setattr(locking, "MOUNTINFO", table)  # what the node would read, were it Lustre
    with pytest.raises(DdpJobError) as err:
        check_locks(cfg)
    assert (
        err.value.message == f"run.root {tmp_path / 'runs'} is on lustre at {point}, mounted with localflock (a "
        "lock holds on its own node only)"
    )
    assert "Lustre mounted -o flock" in err.value.hint
