"""The run directory's permission policy (ddp_core.run.permissions) with real users (tests/support/users.py): alice
makes runs in a setgid project folder she shares with mallory (ddpjob-proj), under umask 002 and 022, and mallory
tries to write (and read) every file and folder of them; then each check refuses, in one line, a file another user
could have changed, before it is unpickled or imported."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from ddp_core.errors import DdpJobError
from ddp_core.run import permissions
from ddp_core.run.rundir import RunDir
from jobs.runs.follow import check_results
from tests.support import users

# Run as mallory: which of the paths listed in argv[1] (a JSON list) she can write, and which files she can read.
PROBE = """
import json, os, sys
writable, readable = [], []
for p in json.load(open(sys.argv[1])):
    if os.path.isdir(p):
        probe = os.path.join(p, ".mallory")
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os.unlink(probe)
            writable.append(p)
        except OSError:
            pass
        continue
    try:
        open(p, "ab").close()  # opened for writing, nothing written
        writable.append(p)
    except OSError:
        pass
    try:
        open(p, "rb").read(1)
        readable.append(p)
    except OSError:
        pass
print(json.dumps({"writable": writable, "readable": readable}))
"""

SCRIPT = 'import os\nprint("trained")\nopen(os.path.join(os.environ["DDPJOB_RUN_DIR"], "out.txt"), "w").write("x")\n'


@pytest.fixture
def project() -> Iterator[Path]:
    """A setgid project folder (2775, group ddpjob-proj) that alice and mallory may both write, under a folder every
    user can enter (a test's tmp_path is root's own, 0700)."""
    alice, _ = users.ensure("alice"), users.ensure("mallory")
    base = Path(tempfile.mkdtemp(prefix="ddpjob-perms-", dir="/tmp"))
    base.chmod(0o755)
    proj = base / "proj"
    proj.mkdir()
    os.chown(proj, 0, users.project_gid())
    proj.chmod(0o2775)
    code = proj / "alice"  # alice's own code, in the shared folder
    code.mkdir()
    (code / "train.py").write_text(SCRIPT)
    os.chown(code, alice.uid, users.project_gid())
    os.chown(code / "train.py", alice.uid, users.project_gid())
    yield proj
    shutil.rmtree(base, ignore_errors=True)


def submit_as_alice(proj: Path, umask: int, *extra: str, env: dict[str, str] | None = None) -> Path:
    """``ddpjob submit --local`` of a script as alice under ``umask``; the run directory it made."""
    alice = users.ensure("alice")
    argv = [users.SYSTEM_PYTHON, "-m", "jobs", "submit", "--local", "--script", "train.py", "run.name=t",
            f"run.root={proj / 'runs'}", "wandb.mode=disabled", *extra]  # fmt: skip
    proc = users.run(alice, argv, cwd=proj / "alice", umask=umask, env=users.python_env(env))
    assert proc.returncode == 0 and "COMPLETED" in proc.stdout, proc.stdout + proc.stderr
    return Path(next(line for line in proc.stdout.splitlines() if line.startswith("run dir:")).split()[-1])


def probe_as_mallory(run: Path, tmp: Path) -> dict[str, list[str]]:
    paths = [str(run), *(str(Path(here) / n) for here, dirs, files in os.walk(run) for n in (*dirs, *files))]
    listing = tmp / "paths.json"
    listing.write_text(json.dumps(paths))
    listing.chmod(0o644)
    proc = users.run(users.ensure("mallory"), [users.SYSTEM_PYTHON, "-c", PROBE, str(listing)], check=True)
    return dict(json.loads(proc.stdout))


def executed_files(run: Path) -> list[Path]:
    """What a job executes or unpickles: the pickles, config.yaml, code.json, the code snapshot."""
    found = [*run.glob("slurm/*.pkl"), run / "config.yaml", run / "code.json", *run.glob("code/**/*")]
    assert {p.name for p in found} >= {"config.yaml", "code.json", "train.py"}
    assert any(p.name.endswith("_submitted.pkl") for p in found) and any(p.name.endswith("_result.pkl") for p in found)
    return found


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_mallory_can_write_nothing_of_a_run_alice_made_in_a_shared_folder(project, umask):
    run = submit_as_alice(project, umask)
    assert (run / "out.txt").is_file()  # the script ran
    for path in [run, run / "slurm", run / "code", *executed_files(run)]:
        mode = path.stat().st_mode
        assert not mode & 0o022, f"{path} {mode:o}"
    seen = probe_as_mallory(run, project.parent)
    assert seen["writable"] == []
    files = [p for p in run.rglob("*") if p.is_file()]
    # The umask decides who reads: 022 lets mallory read every file (as the issue found); 002 as well.
    assert len(seen["readable"]) == len(files) > 10, (len(seen["readable"]), len(files))


@pytest.mark.parametrize("how", ["config", "environment"])
def test_a_private_run_is_closed_to_mallory(project, how):
    extra, env = (["run.private=true"], None) if how == "config" else ([], {"DDPJOB_PRIVATE": "1"})
    run = submit_as_alice(project, 0o002, *extra, env=env)
    files = [p for p in run.rglob("*") if p.is_file()]
    seen = probe_as_mallory(run, project.parent)
    assert seen == {"writable": [], "readable": []} and len(files) > 10
    for path in [run, *run.rglob("*")]:
        assert not path.stat().st_mode & 0o077, f"{path} {path.stat().st_mode:o}"


def test_the_attempt_refuses_a_file_of_the_run_that_another_user_could_change(project):
    """Script mode's start (and the trainer's: both call snapshot.activate) refuses a run whose config.yaml became
    group-writable (an old run, a default ACL), and one whose code holds a file mallory owns."""
    alice = users.ensure("alice")
    run = submit_as_alice(project, 0o022)
    attempt = [users.SYSTEM_PYTHON, "-m", "ddp_core.script", str(run)]
    (run / "config.yaml").chmod(0o664)
    proc = users.run(alice, attempt, cwd=run)
    assert proc.returncode != 0 and "trained" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if "is writable by its group (mode 0664)" in line]
    assert lines and f"{run / 'config.yaml'} is writable by its group" in lines[0], proc.stderr
    assert "chmod go-w" in lines[0]
    (run / "config.yaml").chmod(0o644)
    os.chown(run / "code" / "train.py", users.ensure("mallory").uid, users.project_gid())
    proc = users.run(alice, attempt, cwd=run)
    assert "train.py is owned by ddpjob-mallory" in proc.stderr and "trained" not in proc.stdout, proc.stderr


def test_submitits_job_entry_refuses_a_pickled_call_another_user_could_have_written(project, tmp_path):
    """The batch script's task command (ddp_core.run.entry) before submitit loads the call: a pickle that would leave
    a mark when loaded is refused, group-writable, owned by mallory or in a folder her group can write, and loaded
    once it and its folders are alice's alone."""
    alice = users.ensure("alice")
    folder = project / "run" / "slurm"
    folder.mkdir(parents=True)
    for path in (folder.parent, folder):
        os.chown(path, alice.uid, alice.gid)
        path.chmod(0o755)
    mark = folder.parent / "loaded"
    pkl = folder / "123_submitted.pkl"
    pkl.write_bytes(pickle.dumps(Marker(str(mark))))
    env = users.python_env({"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "123", "SLURM_PROCID": "0",
                            "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                            "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1"})  # fmt: skip
    entry = [users.SYSTEM_PYTHON, "-m", "ddp_core.run.entry", str(folder)]
    (folder.parent / "config.yaml").write_text("run: {}\n")  # a run directory: the refusal is recorded there
    for owner, mode, why in [(alice.uid, 0o664, "is writable by its group"), (users.ensure("mallory").uid, 0o644,
                             "is owned by ddpjob-mallory")]:  # fmt: skip
        os.chown(pkl, owner, alice.gid)
        pkl.chmod(mode)
        proc = users.run(alice, entry, cwd=project, env=env)
        assert proc.returncode == 2 and f"ddpjob: error: {pkl} {why}" in proc.stderr, proc.stderr
        assert not mark.exists()
        # The rank's user error: the watcher ends the job FAILED with it (failures.diagnose), never requeued.
        refused = RunDir(folder.parent).events()[-1]
        assert (refused["event"], refused["kind"], refused["rank"]) == ("rank_failed", "user", 0), refused
        assert refused["error"].startswith(f"DdpJobError: {pkl} {why}"), refused
    os.chown(pkl, alice.uid, alice.gid)
    folder.chmod(0o775)  # the folder, now: mallory could swap the file
    proc = users.run(alice, entry, cwd=project, env=env)
    assert proc.returncode == 2 and f"{folder} is writable by its group" in proc.stderr and not mark.exists()
    folder.chmod(0o755)
    users.run(alice, entry, cwd=project, env=env)  # alice's alone: submitit loads it (and then fails on its content)
    assert mark.exists()


class Marker:
    """Leaves a file when unpickled: what a swapped pickle could run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def test_wait_refuses_a_result_another_user_could_have_written(tmp_path):
    import submitit

    run = RunDir(tmp_path / "run")
    run.slurm.mkdir(parents=True)
    job = submitit.SlurmJob(folder=run.slurm, job_id="77", tasks=[0])
    result = Path(job.task(0).paths.result_pickle)
    result.write_bytes(pickle.dumps(("success", {"eval/loss": 1.0})))
    result.chmod(0o600)
    check_results(job, run)  # the user's own: read
    result.chmod(0o620)
    with pytest.raises(DdpJobError, match=r"77_0_result.pkl is writable by its group \(mode 0620\)"):
        check_results(job, run)
    result.chmod(0o600)
    run.slurm.chmod(0o777)
    with pytest.raises(DdpJobError, match=r"slurm is writable by its group and everyone \(mode 0777\)"):
        check_results(job, run)


def test_tighten_keeps_what_the_umask_closed_and_closes_group_and_world_writes():
    old = os.umask(0o002)
    try:
        assert permissions.tighten() == 0o022
        os.umask(0o027)
        assert permissions.tighten() == 0o027
        assert not permissions.is_private()
    finally:
        os.umask(old)
