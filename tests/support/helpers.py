"""Helpers for tests that run real jobs: logs per rank, digests, Slurm state, W&B offline records."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

FINAL_DIGEST = re.compile(r"final weights sha256 ([0-9a-f]{64})")
ROOT = Path(__file__).resolve().parents[2]  # tests/support/helpers.py
# Between two questions to Slurm while a test waits: root (the SlurmUser) is never rate-limited; a user on a release
# that limits RPCs (the site profile: 30 in the bucket, 2 a second refilled; an squeue is ~3) who asked every 0.5 s
# would keep her bucket empty, and her own job's scontrol requeue at its deadline sat in the client's silent
# retries until the trainer's 15 s ran out (24.11, as alice: the job FAILED).
SLURM_POLL_S = 0.5 if os.geteuid() == 0 else 2.0
_SOURCES = ("ddp_core/**/*.py", "jobs/**/*.py", "tests/**/*.py", "configs/*.yaml", "examples/*.py", "pyproject.toml")


def cached_reference(pytestconfig: Any, name: str, parts: Sequence[str], compute: Callable[[], str]) -> str:
    """``compute()`` (an uninterrupted run's digest), reused from pytest's cache when neither ``parts`` nor any
    source file changed: scripts/test's profile and release passes rerun modules whose references the first pass
    computes. The key covers every source the run could depend on, and torch's version. Those passes run side by
    side, so the first to need a reference computes it while the others wait for it on a lock (each would
    otherwise train the same uninterrupted run again, 2-4 rank processes)."""
    import torch

    key = hashlib.sha256("\0".join([torch.__version__, *parts]).encode())
    for pattern in _SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            key.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    cache = getattr(pytestconfig, "cache", None)  # None under -p no:cacheprovider
    if cache is None:
        return compute()
    digest_key = key.hexdigest()[:32]
    slot = f"ddpjob/reference/{name}/{digest_key}"
    with open(cache.mkdir("ddpjob-reference-locks") / f"{name}-{digest_key}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if isinstance(found := cache.get(slot, None), str):
            return found
        digest = compute()
        cache.set(slot, digest)
        return digest


def two_rank_reference(
    pytestconfig: Any, tmp_path_factory: Any, name: str, config: str, overrides: Sequence[str]
) -> str:
    """The final weights' digest of an uninterrupted run of ``config`` with ``overrides``, 2 ranks under torchrun
    outside Slurm (bitwise a 2-rank job's), reused from pytest's cache (``cached_reference``, slot ``name``)."""

    def run() -> str:
        d = final_digests(run_trainer(config, tmp_path_factory.mktemp("ref") / "run", overrides, nproc=2))
        assert len(d) == 2 and len(set(d)) == 1
        return d[0]

    return cached_reference(pytestconfig, name, [config, *overrides, "nproc=2"], run)


def stop_server(proc: subprocess.Popen[Any], timeout_s: float = 10) -> None:
    """End a server a test started (an S3 or MLflow server on loopback): SIGTERM, then SIGKILL after ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_trainer(
    config: str,
    run_dir: Path,
    overrides: Sequence[str],
    nproc: int = 1,
    env: dict | None = None,
    stopped: bool = False,
    torchrun: bool = False,
) -> str:
    """``python -m ddp_core`` alone (nproc=1) or under torchrun (nproc > 1, or ``torchrun``: a process group even of
    one rank), outside any Slurm job; returns its log. It must finish, or with ``stopped`` exit as a stopped attempt
    does (4; torchrun reports a failed worker as 1)."""
    torchrun = torchrun or nproc > 1
    agent = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    launcher = agent if torchrun else [sys.executable]
    # A hang fails in a minute and a half with every rank's stacks (the watchdog's summary in the log, the stacks
    # in RUN/hangs/), not after the 300 s timeout with nothing to read; a test's own watchdog.* overrides win. (A
    # run directory takes no overrides: it was created from a YAML config that had it.)
    hang = ["watchdog.stall_s=90"] if Path(config).is_file() else []
    cmd = [*launcher, "-m", "ddp_core", config, "--run-dir", str(run_dir), *hang, *overrides]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=clean | {"OMP_NUM_THREADS": "1"} | (env or {})
    )
    assert proc.returncode == ((1 if torchrun else 4) if stopped else 0), proc.stdout + proc.stderr
    return proc.stderr


def final_digests(log: str) -> list[str]:
    return FINAL_DIGEST.findall(log)


def rank_logs(run_dir: Path, job_id: str) -> dict[int, str]:
    """Each rank's stderr log of a job (all attempts: requeued attempts append to the same file)."""
    logs = {}
    for path in sorted((run_dir / "slurm").glob(f"{job_id}_*_log.err")):
        rank = path.name[len(job_id) + 1 :].split("_")[0]  # <job>_<rank>_log.err; array jobs: <array>_<index>
        if rank.isdigit():
            logs[int(rank)] = path.read_text()
    return logs


def digests(logs: dict[int, str]) -> dict[int, str]:
    """The last final-weights digest each rank logged."""
    out = {}
    for rank, text in logs.items():
        found = FINAL_DIGEST.findall(text)
        assert found, f"rank {rank} logged no final digest:\n{text[-3000:]}"
        out[rank] = found[-1]
    return out


def sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True)
    return out.stdout.strip()


def in_queue(job_id: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip())


def wait_idle(timeout: float = 120) -> None:
    """Until no job is queued or running: a preemption test must not meet another test's leftover high-priority
    job (a drill's twin, a preemptor still pending), which would preempt its job once more."""
    idle = lambda: not subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    wait_for(idle, timeout, "an idle cluster", poll=SLURM_POLL_S)


def wait_for(condition: Callable[[], Any], timeout: float, what: str, poll: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_out_of_queue(job_id: str, timeout: float = 300) -> None:
    """Until the job (or array) is no longer queued or running, asking every ``SLURM_POLL_S``."""
    wait_for(lambda: not in_queue(job_id), timeout, f"job {job_id} to leave the queue", poll=SLURM_POLL_S)


def wait_gone(job_id: str, timeout: float = 300) -> str:
    wait_out_of_queue(job_id, timeout)
    # The last record's state: a job that lost a node has a RESIZING record before it, and after slurmdbd was down
    # its last record says PENDING until the controller's held-back updates arrive (the storm's seed 5: RESIZING,
    # then PENDING, read as the end of a job that had completed).
    return wait_for(lambda: (s := sacct_state(job_id)) and s.split()[-1] not in ("RUNNING", "COMPLETING", "PENDING")
                    and s, 60, "sacct's final state", poll=SLURM_POLL_S)  # fmt: skip


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    path = run_dir / "attempts.jsonl"
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in out if kind is None or e["event"] == kind]


def metric_steps(run_dir: Path, split: str = "train") -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record["split"] == split:
            steps.append(record["step"])
    return steps


def rank_pid(job_id: str, rank: int) -> int | None:
    """The pid of a job's rank process (the local cluster's nodes share this machine's pid space)."""
    return next(iter(task_pids(job_id, rank)), None)


def task_pids(job_id: str, rank: int | None = None) -> list[int]:
    """The pids of a job step's task processes (of one rank, or all): python, or ``env`` about to exec it."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"python" not in cmdline or b"srun" in cmdline:
            continue
        if (
            f"SLURM_JOB_ID={job_id}".encode() in environ
            and (rank is None or f"SLURM_PROCID={rank}".encode() in environ)
            and any(e.startswith(b"SLURM_STEP_ID=") for e in environ)
        ):
            found.append(int(proc.name))
    return found


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B ``.wandb`` transaction log, parsed with wandb's own protobuf schema.

    The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
    chunks (crc32, length, type FULL/FIRST/MIDDLE/LAST) whose payloads are ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    data, pos, block = path.read_bytes(), 7, 32768
    assert data[:4] == b":W&B", path
    payloads, partial = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            payloads.append(partial + chunk)
    return [wandb_internal_pb2.Record.FromString(p) for p in payloads]


def write_shadowing_files(folder: Path) -> None:
    """A user's ``jobs.py``, ``ddp_core.py`` and ``submitit.py`` in ``folder``, a submit directory, each failing loudly
    when imported: Slurm starts the batch script and its tasks there, and they must run ddpjob's own packages
    (``ddp_core.python_m``)."""
    for name in ("jobs", "ddp_core", "submitit"):
        (folder / f"{name}.py").write_text(f"raise SystemExit('{name}.py in the submit directory was imported')\n")


def run_script(cfg: Any, run: Any, python: str = sys.executable) -> str:
    """The batch script ``ddpjob submit`` queues for ``cfg`` in the run directory ``run`` (the pipeline's resolve and
    render steps, without the checks)."""
    from jobs.submission.render import Layout, render
    from jobs.submission.request import SlurmRequest

    return render(SlurmRequest.resolve(cfg, python=python, run_root=run.path.parent), Layout.run(run.path))


def template_script(cfg: Any, run: Any, python: str = sys.executable) -> str:
    """``slurm_templates/ddp.sbatch`` rendered for ``cfg`` in ``run``, as ``prepare --sbatch-script`` writes it."""
    from jobs.submission.render import render_template
    from jobs.submission.request import SlurmRequest

    return render_template(SlurmRequest.resolve(cfg, python=python, run_root=run.path.parent), run)


def running_profile() -> str:
    """The local cluster's profile (see scripts/slurm-local), read from its configuration."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    if "proctrack/cgroup" in out:
        return "site"  # the only profile with cgroups
    if "preempt/partition_prio" in out:
        return "preempt-signal" if "preempt_send_user_signal" in out else "preempt"
    return "preempt-qos" if "preempt/qos" in out else "default"


def submit_and_kill_node(overrides: Sequence[str], cwd: Path, node: str, halted: Path) -> tuple[int, str, str]:
    """``ddpjob submit --wait`` with ``overrides`` (a ``CrashingTask`` with ``error=HALT`` and ``halt_file=halted``):
    once a rank on ``node`` has halted at its chosen batch, the node dies whole from outside (``scripts/slurm-local
    kill-node``: its slurmd and every process on it), at that step rather than at a raced moment; the node is brought
    back after the job ends, whatever happened. Returns the command's exit code, stdout and stderr. As root or as a
    plain user (``tests.support.faults``)."""
    from tests.support.faults import slurm_local  # it imports this module's ROOT

    cmd = [sys.executable, "-m", "jobs", "submit", *overrides]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(halted.exists, 120, f"a rank on {node} to reach its chosen batch")
        killed = slurm_local("kill-node", node)
        assert killed.returncode == 0, killed.stdout + killed.stderr
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        started = slurm_local("start-node", node)
    assert started.returncode == 0, started.stdout + started.stderr
    return proc.returncode, out, err


def submit_and_lose_batch_node(
    args: Sequence[str], cwd: Path, marked: Path, node: str = "n1", thaw: bool = True
) -> tuple[int, str, str]:
    """``ddpjob submit --wait ARGS`` of a job whose batch node is ``node``: once its rank 0 has written ``marked`` (at a
    chosen step), ``node`` dies as the other nodes see a dead host (``scripts/slurm-local freeze-node``: its processes
    stopped, their connections open and silent); once the run recorded its requeue, the frozen processes are killed
    and the node comes back for the next attempt (``thaw=False``: it stays frozen, its processes' locks held, until
    the command ends). Whatever happens, a job left running is cancelled and the node is back at the end. Returns the
    command's exit code, stdout and stderr. As root or as a plain user (``tests.support.faults``)."""
    from tests.support.faults import slurm_local  # it imports this module's ROOT

    cmd = [sys.executable, "-m", "jobs", "submit", "--wait", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(marked.exists, 120, "rank 0 to reach its chosen step")
        frozen = slurm_local("freeze-node", node)
        assert frozen.returncode == 0, frozen.stdout + frozen.stderr
        run_dir = next((cwd / "runs").iterdir())
        wait_for(lambda: events(run_dir, "requeued"), 120, "the job to be requeued")
        for act in ("kill-node", "start-node") if thaw else ():
            done = slurm_local(act, node)
            assert done.returncode == 0, f"slurm-local {act} {node}: exit {done.returncode}: {done.stdout}{done.stderr}"
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
        for script in cwd.glob("runs/*/slurm/*_submission.sh"):  # a job left running by a failed assertion
            subprocess.run(["scancel", script.name.split("_")[0]], capture_output=True, timeout=30)
        for act in ("kill-node", "start-node"):  # kill-node finds nothing left once the above ran
            slurm_local(act, node)
    return proc.returncode, out, err
