"""The user pass's root fault broker (tests/support/faults.py): only its user reaches it, and it runs nothing but
its fixed injections. A real broker forked from this (root) process, asked by real users (tests/support/users.py);
the one injection it runs here cannot reach a cluster (a port base out of range: scripts/slurm-local refuses it
before anything else), so the test needs none."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
from typing import Iterator

import pytest

from tests.support import faults, users
from tests.support.helpers import ROOT

# A client that sends its argv's JSON to the broker as is (slurm_local would refuse a bad request before sending it).
RAW = """import json, socket, sys
conn = socket.socket(socket.AF_UNIX)
try:
    conn.connect(sys.argv[1])
except OSError as err:
    sys.exit(f"connect: {err.strerror}")
conn.sendall(sys.argv[2].encode() + b"\\n")
print(conn.makefile().read())
"""


@pytest.fixture
def broker(monkeypatch, tmp_path) -> Iterator[tuple[users.User, str]]:
    alice = users.ensure("alice")
    monkeypatch.setenv("DDPJOB_SLURM_HOME", str(tmp_path / "no-cluster"))
    monkeypatch.setenv("SLURM_LOCAL_PORT_BASE", "1")  # inherited by the broker: slurm-local stops at it
    path, pid = faults.start_broker(alice.uid, alice.gid)
    try:
        yield alice, str(path)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        shutil.rmtree(path.parent, ignore_errors=True)


def ask(user: users.User, path: str, request: object) -> str:
    proc = users.run(user, [users.SYSTEM_PYTHON, "-c", RAW, path, json.dumps(request)], timeout=60)
    return (proc.stdout + proc.stderr).strip()


@pytest.mark.parametrize(
    "args",
    [[], ["up"], ["down"], ["kill-node"], ["kill-node", "n4"], ["kill-node", "n1", "n2"], ["kill-node", "n1;id"],
     ["stop-accounting", "n1"], ["resume-node"], ["resume-node", "ALL"], ["env"], ["--help"]],
)  # fmt: skip
def test_only_the_fixed_injections_are_a_command(args):
    with pytest.raises(ValueError, match="not a"):
        faults.command(args)


def test_each_request_is_one_fixed_command():
    assert faults.command(["kill-node", "n2"]) == [str(ROOT / "scripts" / "slurm-local"), "kill-node", "n2"]
    assert faults.command(["stop-accounting"]) == [str(ROOT / "scripts" / "slurm-local"), "stop-accounting"]
    assert faults.command(["resume-node", "n3"]) == ["scontrol", "update", "NodeName=n3", "State=RESUME"]


def test_the_broker_serves_its_user_only_and_runs_only_its_injections(broker):
    alice, path = broker
    folder = os.stat(os.path.dirname(path))
    assert (folder.st_uid, folder.st_mode & 0o777) == (alice.uid, 0o700)
    assert (os.stat(path).st_uid, os.stat(path).st_mode & 0o777) == (alice.uid, 0o600)
    # Another user cannot even reach the socket; root (here) reaches it and is refused by its peer uid.
    mallory = users.ensure("mallory")
    assert ask(mallory, path, ["start-node", "n1"]) == "connect: Permission denied"
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(path)
        conn.sendall(b'["start-node", "n1"]\n')
        refused = json.loads(conn.makefile().read())
    why = f"fault broker: uid 0 may not ask this broker (it serves uid {alice.uid})\n"
    assert refused == {"returncode": 2, "stdout": "", "stderr": why}
    # Hers: anything but an injection is refused; an injection reaches scripts/slurm-local, run as root.
    for bad, why in [(["up"], "not a fault injection"), (["kill-node", "n1 n2"], "not a node of the local cluster"),
                     ("kill-node n1", "not a list of words"), ({"a": 1}, "not a list of words")]:  # fmt: skip
        reply = json.loads(ask(alice, path, bad))
        assert reply["returncode"] == 2 and reply["stderr"].startswith(f"fault broker: {why}"), (bad, reply)
    reply = json.loads(ask(alice, path, ["kill-node", "n1"]))
    assert reply["returncode"] == 1, reply
    assert "slurm-local: error: SLURM_LOCAL_PORT_BASE must be a port number" in reply["stderr"], reply


def test_slurm_local_as_a_user_goes_through_the_broker(broker):
    alice, path = broker
    script = (
        "from tests.support.faults import slurm_local as s; p = s('stop-accounting'); print(p.returncode, p.stderr)"
    )
    env = users.python_env({faults.BROKER_ENV: path})
    proc = users.run(alice, [users.SYSTEM_PYTHON, "-c", script], env=env, timeout=60)
    assert proc.stdout.startswith("1 slurm-local: error: SLURM_LOCAL_PORT_BASE must be"), proc.stdout + proc.stderr
    without = users.run(alice, [users.SYSTEM_PYTHON, "-c", script], timeout=60)
    assert "stop-accounting needs root: as a plain user run pytest through tests.support.as_user" in without.stderr
