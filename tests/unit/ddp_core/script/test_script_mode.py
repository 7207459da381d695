"""Script mode without Slurm: ``python -m ddp_core.script RUN`` started by hand, once per rank, with the variables an
srun task has, running a plain torchrun script and one that stops and resumes through ``ddp_core.runtime``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Sequence

import pytest
import yaml

from ddp_core.cluster.env import DistEnv, derive_master_port
from ddp_core.cluster.exits import ExitCode
from ddp_core.config import load_config, to_yaml
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from ddp_core.script.mode import read_script_spec, script_environment
from tests.support.helpers import FINAL_DIGEST, ROOT, events, metric_steps
from tests.support.script_ranks import HOST, Ranks, clean_env, make_run, srun_task_env

TUTORIAL = ROOT / "examples" / "ddp_tutorial.py"
CHARLM = ROOT / "examples" / "charlm_script.py"
EXIT_STOPPED = ExitCode.STOPPED


def test_tutorial_runs_unchanged_under_the_launcher(tmp_path):
    run = make_run(tmp_path, TUTORIAL, args=["--steps", "5"])
    ranks = Ranks(run, 2, tmp_path / "logs", job_id="4242")
    assert ranks.wait() == [0, 0], ranks.all_text()
    for r in (0, 1):
        out = ranks.text(r)
        assert f"rank {r}/2 local_rank {r} master {HOST}:{ranks.port}" in out, out
        assert f"rank {r}: final loss" in out and "after 5 steps" in out, out  # script.args reached it
    assert [e["event"] for e in events(run)] == ["start", "completed"]
    start = events(run, "start")[0]
    assert (start["job_id"], start["world_size"], start["restart_count"]) == ("4242", 2, 0)


def test_launcher_exports_torchruns_contract(tmp_path):
    run = RunDir(make_run(tmp_path, TUTORIAL))
    slurm = {k: v for k, v in srun_task_env(1, 2, 0, "4242").items() if k.startswith("SLURM_")}
    env = DistEnv.from_env(slurm)  # no MASTER_PORT: derived from the job id, as in a real job
    # Rank 0 publishes the port its script will listen on (the derived one: free here); rank 1 reads it.
    first = DistEnv.from_env({k: v for k, v in srun_task_env(0, 2, 0, "4242").items() if k.startswith("SLURM_")})
    assert script_environment(first, run, "USR1")["MASTER_PORT"] == str(derive_master_port(4242))
    exported = script_environment(env, run, "USR1", init_timeout_s=5)
    assert {k: exported[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"
    }  # fmt: skip
    assert (exported["MASTER_ADDR"], exported["MASTER_PORT"]) == (HOST, str(derive_master_port(4242)))
    assert exported["DDPJOB_RUN_DIR"] == str(run.path)
    assert exported["DDPJOB_CHECKPOINT_DIR"] == str(run.checkpoints)
    assert (exported["DDPJOB_RESTART_COUNT"], exported["DDPJOB_SIGNAL"]) == ("0", "USR1")
    # What the script's own DistEnv reads back from them (ddp_core.runtime builds one) is the launcher's identity.
    again = DistEnv.from_env(slurm | exported)
    assert (again.rank, again.world_size, again.local_rank, again.master_port) == (1, 2, 1, env.master_port)
    assert again.slurm_job_id == "4242"


def _run_charlm(tmp_path: Path, name: str, args: Sequence[str]) -> tuple[Path, Ranks]:
    run = make_run(tmp_path, CHARLM, args=args, name=name)
    return run, Ranks(run, 2, tmp_path / f"logs-{name}")


def _digests(ranks: Ranks) -> list[str]:
    found = [FINAL_DIGEST.findall(ranks.text(r)) for r in (0, 1)]
    assert all(found), ranks.all_text()
    return [f[-1] for f in found]


def test_charlm_script_stopped_by_usr2_to_one_rank_resumes_at_its_step(tmp_path):
    """USR2 to rank 1 alone: both ranks stop after the same step (exit 4 outside Slurm, the checkpoint written, how to
    continue said), and started again they resume there and complete, with one digest. That the resumed weights are
    an uninterrupted run's is the script's own doing, the same under any launcher: tests/cluster/test_script_jobs.py
    proves it on the local cluster (srun twice, torchrun once), so no uninterrupted twin runs here."""
    steps = 100
    args = ["--steps", str(steps), "--save-every", "30", "--log-every", "10"]
    run, first = _run_charlm(tmp_path, "stopped", args)
    # Past step 20 of 100 (rank 0 logged it), signal rank 1 alone; stopped first, so it cannot finish meanwhile.
    deadline = time.monotonic() + 90
    while not any(s >= 20 for s in metric_steps(run)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in first.procs), first.all_text()
        time.sleep(0.02)
    os.kill(first.procs[1].pid, signal.SIGSTOP)
    try:
        assert max(metric_steps(run)) < steps - 20, "ran too far before the signal"
        os.kill(first.procs[1].pid, signal.SIGUSR2)
    finally:
        os.kill(first.procs[1].pid, signal.SIGCONT)
    assert first.wait() == [EXIT_STOPPED, EXIT_STOPPED], first.all_text()
    stop = events(run, "interrupted")[0]
    assert stop["kind"] == "stopped" and 20 <= stop["step"] < steps, stop
    assert f"continue with: python -m ddp_core.script {run}" in first.text(0)
    assert all(f"stopping at step {stop['step']}" in first.text(r) for r in (0, 1))  # the same step on both ranks
    assert (run / "checkpoints" / f"step_{stop['step']:08d}.pt").is_file()

    second = Ranks(run, 2, tmp_path / "logs-resumed")
    assert second.wait() == [0, 0], second.all_text()
    assert f"resumed from step_{stop['step']:08d}.pt" in second.text(1)
    final = _digests(second)
    assert final[0] == final[1]
    assert [e["event"] for e in events(run)] == ["start", "interrupted", "start", "completed"]
    assert metric_steps(run) == list(range(10, steps + 1, 10))


def test_requeue_inside_a_slurm_job_uses_the_trainers_decision(tmp_path):
    """runtime.requeue() in a Slurm job (a fake scontrol on PATH): the trainer's decision, events and exit codes (its
    budgets are the trainer's own code, tested with the trainer)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {tmp_path}/scontrol.calls
        if [ "$1" = show ]; then echo "JobId=$4 JobState=RUNNING Requeue=1 Restarts=0 EndTime=Unknown"; fi
    """)
    )
    (fake / "scontrol").chmod(0o755)
    script = tmp_path / "stops.py"
    script.write_text(
        textwrap.dedent("""\
        import os, signal
        import torch.distributed as dist
        from ddp_core import runtime
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR2)  # Slurm's warning signal, to one rank only
        while not runtime.stop_requested():
            pass
        runtime.requeue(step=7)
        raise AssertionError("requeue() returned")
    """)
    )
    run = make_run(tmp_path, script)
    path = f"{fake}{os.pathsep}{os.environ['PATH']}"
    ranks = Ranks(run, 2, tmp_path / "logs", job_id="4343", extra={"PATH": path})
    assert ranks.wait(90) == [0, 0], ranks.all_text()
    assert [e["event"] for e in events(run)] == ["start", "interrupted", "requeued"]
    stop = events(run, "interrupted")[0]
    assert (stop["kind"], stop["step"], stop["job_id"]) == ("timeout", 7, "4343")
    calls = (tmp_path / "scontrol.calls").read_text().splitlines()
    assert calls[0] == "show job -o 4343"  # rank 0 alone asks Slurm
    assert "requeue 4343" in calls
    assert events(run, "requeued")[0]["count"] == 1


def test_failing_rank_exits_1_naming_itself(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        textwrap.dedent("""\
        import os
        if os.environ["RANK"] == "1":
            raise RuntimeError("boom on purpose")
        print("rank 0 done", flush=True)
    """)
    )
    run = make_run(tmp_path, script)
    ranks = Ranks(run, 2, tmp_path / "logs")
    assert ranks.wait(60) == [0, 1], ranks.all_text()
    err = ranks.err[1].read_text()
    assert f"[rank 1/2] ERROR ddp_core.script: rank 1/2 on {HOST} failed: RuntimeError: boom on purpose" in err, err
    assert "Traceback" in err  # the user's own frames, for the fix
    # rank 0's own part went fine; rank 1 recorded its failure for the batch script's watcher (cluster.failures)
    assert [e["event"] for e in events(run) if e["event"] != "rank_failed"] == ["start", "completed"]
    (failed,) = events(run, "rank_failed")
    assert (failed["rank"], failed["kind"], failed["error"]) == (1, "unknown", "RuntimeError: boom on purpose")


def test_module_mode_argv_and_exit_codes(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        textwrap.dedent("""\
        import os, sys
        print("argv", sys.argv[1:], "rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], flush=True)
        if __name__ == "__main__":
            sys.exit(int(sys.argv[1]))
    """)
    )
    env = clean_env(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    for code in (3, 0):
        run = make_run(tmp_path, module="mypkg.train", args=[str(code), "--lr=1e-3"], name=f"run{code}")
        proc = subprocess.run([sys.executable, "-m", "ddp_core.script", str(run)], env=env, capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)  # fmt: skip
        assert proc.returncode == code, proc.stdout + proc.stderr
        assert f"argv ['{code}', '--lr=1e-3'] rank 0 of 1" in proc.stdout
        expected = ["start", "completed"] if code == 0 else ["start"]
        assert [e["event"] for e in events(run)] == expected
        if code:
            assert "the script exited with code 3" in proc.stderr


def test_runtime_imports_without_torch_and_agrees_locally(tmp_path):
    code = textwrap.dedent("""\
        import os, signal, sys
        import ddp_core.runtime as runtime
        assert "torch" not in sys.modules, "importing ddp_core.runtime loaded torch"
        assert not runtime.stop_requested()
        os.kill(os.getpid(), signal.SIGUSR1)  # the run's warning signal, from DDPJOB_SIGNAL
        assert runtime.stop_requested() and runtime.stop_requested()
        assert "torch" not in sys.modules, "stop_requested() without a process group loaded torch"
        assert runtime.restart_count() == 0 and not runtime.in_ddpjob()
        try:
            runtime.checkpoint_dir()
        except Exception as err:
            print(type(err).__name__, err)
        runtime.log({"loss": 1.5}, step=3)  # outside ddpjob: a log line, no file
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(DDPJOB_SIGNAL="USR1"), capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DdpJobError this script is not running under ddpjob (DDPJOB_RUN_DIR is not set)" in proc.stdout
    assert proc.stdout.endswith("ok\n")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("script", "message"),
    [
        (None, "has no script section (script.path or script.module): this run has no script"),
        ({"path": "/x.py", "module": "m"}, "'script.path' and 'script.module' are both set"),
        ({"path": "train.py"}, "'script.path' must be an absolute path"),
        ({"path": "/nonexistent/train.py"}, "script /nonexistent/train.py does not exist on"),
        ({"module": "pkg/train"}, "config key 'script.module' = 'pkg/train' is invalid: must be a dotted module name"),
        ({"module": "m", "args": "--lr=1"}, "config key 'script.args'"),
        ({"module": "m", "argv": []}, "unknown config key 'script.argv'"),
        ({"args": ["--lr=1"]}, "config key 'script.args' is set but no script is"),
        ({"module": "m", "sha256": "abc"}, "config key 'script.sha256' = 'abc' is invalid"),
    ],
)
def test_script_spec_errors(tmp_path, script, message):
    """What the compute node refuses in a run's script section (a hand-written or damaged config.yaml)."""
    rd = RunDir(tmp_path)
    data = yaml.safe_load(to_yaml(load_config(None, ["run.name=r"])))
    if script is not None:
        data["script"] = script  # as written by hand: whatever shape the row gives
    rd.config_file.write_text(yaml.safe_dump(data))
    with pytest.raises(DdpJobError) as err:
        read_script_spec(rd)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_script_changed_since_submit_is_run_with_a_warning(tmp_path, caplog):
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    run = make_run(tmp_path, script, overrides=[f"script.sha256={'ab' * 32}"])
    with caplog.at_level("WARNING", logger="ddp_core.script"):
        spec = read_script_spec(RunDir(run))
    assert spec.path == str(script) and spec.args == ()
    assert f"{script} changed since it was submitted" in caplog.text


def test_resume_args_are_appended_after_the_runs_first_attempt(tmp_path):
    from ddp_core.config.features import ScriptConfig
    from ddp_core.script.mode import resumed_attempt, spec_from_config

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    cfg = ScriptConfig(path=str(script), args=["--steps", "9"], resume_args=["--init_from=resume"])
    assert spec_from_config(cfg).args == ("--steps", "9")
    assert spec_from_config(cfg, resumed=True).args == ("--steps", "9", "--init_from=resume")
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    first = DistEnv(job_id="7", slurm_job_id="7", restart_count=0)
    assert not resumed_attempt(run, first)
    run.log_event("start", job_id="7", restart_count=0)
    assert not resumed_attempt(run, first)  # its own start, whichever rank reads it after rank 0 wrote it
    assert resumed_attempt(run, DistEnv(job_id="7", slurm_job_id="7", restart_count=1))  # requeued
    assert resumed_attempt(run, DistEnv(job_id="8", slurm_job_id="8"))  # ddpjob resume: a new job
    with pytest.raises(DdpJobError, match=r"'script\.resume_args' is set but no script is"):
        load_config(None, ["run.name=x", "script.resume_args=[--resume]"])
