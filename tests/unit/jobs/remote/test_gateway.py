"""The SSH gateway's options and its reading of ssh's failures (the real server's answers: test_ssh.py)."""

from __future__ import annotations

import pytest

from jobs.remote.hosts import Host
from jobs.remote.ssh import Gateway, explain, remote_error

HOST = Host("big", "login.big.edu", "/home/me/p", ".venv/bin/ddpjob", connect_timeout=4)


def test_options_persist_the_connection_and_prompt_only_in_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPJOB_STATE_DIR", str(tmp_path / "state"))
    batch = Gateway(HOST, interactive=False).options()
    assert "ControlMaster=auto" in batch and f"ControlPath={tmp_path / 'state' / 'ddpjob-%C'}" in batch
    assert "ControlPersist=10m" in batch and "ConnectTimeout=4" in batch and "BatchMode=yes" in batch
    assert "BatchMode=yes" not in Gateway(HOST, interactive=True).options()  # a two-factor login is typed here once
    # A HOME that is not the account's own (a sandbox, the tests' laptop): its SSH config is the one read.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host big\n")
    assert Gateway(HOST, interactive=False).options()[:2] == ["-F", str(tmp_path / ".ssh" / "config")]


@pytest.mark.parametrize(
    ("stderr", "start", "fix"),
    [
        ("ssh: Could not resolve hostname login.big.edu: Name or service not known", "unknown host big (login.big.edu)",
         "add 'Host big' to ~/.ssh/config"),
        ("@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed.",
         "big (login.big.edu) refused: its host key", "log in once with `ssh login.big.edu`"),
        ("me@login.big.edu: Permission denied (publickey,keyboard-interactive).",
         "big (login.big.edu) refused the login", "run the ddpjob command once in a terminal"),
        ("ssh: connect to host login.big.edu port 22: Connection timed out", "big (login.big.edu) is unreachable",
         "the VPN"),
        ("kex_exchange_identification: read: Connection reset by peer", "ssh to big (login.big.edu) failed", "ssh -v"),
    ],
)  # fmt: skip
def test_each_ssh_failure_is_one_line_naming_the_host_and_the_fix(stderr, start, fix):
    err = explain(HOST, stderr)
    assert err.message.startswith(start) and fix in err.hint and "\n" not in str(err)


def test_the_remotes_own_error_line_is_the_same_error_here():
    err = remote_error("some warning\nddpjob: error: no runs found under ./runs (hint: pass a run directory)\n")
    assert err is not None and (err.message, err.hint) == ("no runs found under ./runs", "pass a run directory")
    assert remote_error("Traceback ...") is None
