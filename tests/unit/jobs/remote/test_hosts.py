"""The host file: an entry's keys, the defaults without one, --remote-dir over both, and its one-line errors."""

from __future__ import annotations

import pytest

from ddp_core.errors import DdpJobError
from jobs.remote import hosts


def test_an_entry_and_the_defaults(tmp_path, monkeypatch):
    path = tmp_path / "hosts.yaml"
    path.write_text("big:\n  host: login.big.edu\n  remote_dir: /home/me/p\n  ddpjob: python -m jobs\n"
                    "  setup: module load python\n  connect_timeout: 3\n")  # fmt: skip
    monkeypatch.setenv(hosts.HOSTS_ENV, str(path))
    big = hosts.lookup("big")
    assert (big.destination, big.remote_dir, big.ddpjob, big.setup, big.connect_timeout) == (
        "login.big.edu", "/home/me/p", "python -m jobs", "module load python", 3.0
    )  # fmt: skip
    assert hosts.lookup("big", remote_dir="/scratch/p").remote_dir == "/scratch/p"
    # A name without an entry: a host of the SSH config, run in this project's own path with its .venv's ddpjob.
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    monkeypatch.chdir(project / "sub")
    plain = hosts.lookup("login1")
    assert (plain.destination, plain.remote_dir, plain.ddpjob, plain.setup) == (
        "login1", str((project / "sub").resolve()), ".venv/bin/ddpjob", ""
    )  # fmt: skip


def test_no_host_file_and_a_project_in_git(tmp_path, monkeypatch):
    monkeypatch.setenv(hosts.HOSTS_ENV, str(tmp_path / "absent.yaml"))
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    (tmp_path / "repo" / "src").mkdir()
    monkeypatch.chdir(tmp_path / "repo" / "src")
    assert hosts.lookup("c").remote_dir == str((tmp_path / "repo").resolve())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("big:\n  hots: x\n", "entry 'big' has unknown key(s) hots"),
        ("big: [a]\n", "entry 'big' is not a mapping"),
        ("big:\n  connect_timeout: soon\n", "big.connect_timeout = 'soon' is not a number of seconds"),
        ("big: {host: [\n", "hosts.yaml"),
    ],
)
def test_a_bad_entry_is_one_line(tmp_path, monkeypatch, text, message):
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    monkeypatch.setenv(hosts.HOSTS_ENV, str(path))
    with pytest.raises(DdpJobError) as err:
        hosts.lookup("big")
    assert message in str(err.value) and "\n" not in str(err.value)
