"""Sweeps of a script (``script.args.NAME=v1,v2``) and what status, logs and report say about script runs.

Without Slurm: how swept values become each trial's arguments (and what is refused, in one line, before anything
exists); the array's task function and run directories, with submitit's executor faked; then each trial run for
real by ``python -m ddp_core.script TRIAL`` (the script logging through ``ddp_core.runtime``), and status, logs and
report read what those runs wrote. A sweep of four trials as one job array on the cluster:
tests/cluster/test_script_sweep_array.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

from ddp_core.config import ScriptConfig
from ddp_core.config.features import arg_value, with_swept_args
from ddp_core.config.trials import load_trial_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.cli import main
from jobs.doctor import drill
from jobs.report import write_report
from jobs.runs import logs, status
from jobs.sweeps import arrays as sw
from jobs.sweeps.spec import load_sweep
from tests.support.cli_runner import run_cli
from tests.support.fake_slurm import FakeSlurm
from tests.support.helpers import ROOT, events
from tests.support.report_pages import figures as report_figures
from tests.support.script_ranks import clean_env
from tests.support.script_sweeps import QUIET, TRAIN, trials_of

DIGITS = str(ROOT / "configs" / "digits.yaml")


def script(*args: str, style: str = "flag") -> ScriptConfig:
    return ScriptConfig(path=TRAIN, args=list(args), arg_style=style)


# --- how swept values become arguments ------------------------------------------------------------------------


def test_swept_args_follow_the_fixed_ones_in_key_order():
    swept = {"lr": "1e-4", "save-every": "10", "tag": "'a,b'", "amp": "true", "none": "null", "d": '"x\\ty"'}
    assert with_swept_args(script("--steps", "40"), swept) == [
        "--steps", "40", "--lr=1e-4", "--save-every=10", "--tag=a,b", "--amp=true", "--none=null", "--d=x\ty"
    ]  # fmt: skip
    hydra = with_swept_args(script("+trainer.x=1", style="hydra"), {"optim.lr": "3e-4", "model": "resnet"})
    assert hydra == ["+trainer.x=1", "optim.lr=3e-4", "model=resnet"]
    assert [arg_value(t) for t in ("1e-4", "'it''s'", "'a' 'b'", "''", "[1, 2]")] == [
        "1e-4", "it's", "'a' 'b'", "", "[1, 2]"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "swept", "message"),
    [
        (ScriptConfig(), {"lr": "1"}, "sweep key 'script.args.lr' is a script argument, but the sweep runs no script"),
        (script(), {"l.r": "1"}, "sweep key 'script.args.l.r': 'l.r' is not an option name"),
        (script(), {"2x": "1"}, "'2x' is not an option name"),
        (script(style="hydra"), {"a..b": "1"}, "'a..b' is not a Hydra key"),
        (
            script("--lr", "3"),
            {"lr": "1"},
            "sweep key 'script.args.lr' is also in the script's fixed arguments ('--lr')",
        ),
        (script("--lr=3"), {"lr": "1"}, "fixed arguments ('--lr=3')"),
        (script("++lr=3", style="hydra"), {"lr": "1"}, "fixed arguments ('++lr=3')"),
        (script("~lr", style="hydra"), {"lr": "1"}, "fixed arguments ('~lr')"),
    ],
)
def test_swept_args_refused(cfg, swept, message):
    with pytest.raises(DdpJobError) as err:
        with_swept_args(cfg, swept)
    assert message in err.value.message and err.value.hint


def test_similar_fixed_arguments_are_no_clash():
    assert with_swept_args(script("--lr-decay=1", "--lrx"), {"lr": "2"})[-1] == "--lr=2"
    assert with_swept_args(script("lr_decay=1", style="hydra"), {"lr": "2"})[-1] == "lr=2"


def test_cli_sweep_of_a_script_trials_and_ids():
    sweep = load_sweep(None, ["script.args.lr=1e-4,0.0001,3e-4", "script.args.steps=5", QUIET], script=TRAIN,
                       script_args=["--log-every", "5"])  # fmt: skip
    assert sweep.name == "script_sweep_train-sweep" and sweep.base_config is None
    assert [cfg.script.args for cfg in sweep.configs] == [
        ["--log-every", "5", "--steps=5", f"--lr={lr}"] for lr in ("1e-4", "0.0001", "3e-4")
    ]  # single-valued keys come first (they are fixed), then the swept ones
    # Written as they are: 1e-4 and 0.0001 are two trials (the script gets different text), unlike optim.lr's.
    assert len({t.trial_id for t in sweep.trials}) == 3
    assert [t.params for t in sweep.trials] == [{"script.args.lr": v} for v in ("1e-4", "0.0001", "3e-4")]
    for trial in sweep.trials:  # the trial's overrides rebuild its config
        assert load_trial_config(None, trial.overrides) == sweep.configs[trial.index]


def test_fixed_arguments_reach_the_trials_exactly_as_given(tmp_path):
    """`-- ARGS` travel through the sweep's override text: nothing in them is read as YAML or resolved."""
    awkward = ['a"b', "x,y", "c]d", "it's", "--k=v w", "", "ü 𝄞", "tab\there", "null", "1e-4", "[x]", "{a: 1}",
               "range(1,3)", "#c", "${x}", "a\\${HOME}", "x\\"]  # fmt: skip
    sweep = load_sweep(None, ["script.args.lr=1,2", QUIET], script=TRAIN, script_args=awkward)
    assert [cfg.script.args for cfg in sweep.configs] == [[*awkward, "--lr=1"], [*awkward, "--lr=2"]]
    run = RunDir(tmp_path / "trial")
    run.initialize(sweep.configs[0])
    assert run.load_config().script.args == [*awkward, "--lr=1"]  # and so on the compute node


def test_sweep_file_of_a_script(tmp_path):
    """A sweep YAML needs no base for a script; quoted values keep their spelling, YAML numbers are written as Python
    writes them, random draws too; --script and -- on the command line replace the file's."""
    path = tmp_path / "lr.yaml"
    path.write_text(
        f"name: lr\noverrides: {{script.path: {TRAIN}, script.args: [--steps, '10'], wandb.mode: disabled}}\n"
        "grid: {script.args.lr: ['1e-4', 3.0e-4]}\n"
        "random: {trials: 2, seed: 1, params: {script.args.seed: {dist: randint, low: 0, high: 100}}}\n"
    )
    sweep = load_sweep(path)
    args = [cfg.script.args for cfg in sweep.configs]
    assert [a[:3] for a in args] == [["--steps", "10", "--lr=1e-4"]] * 2 + [["--steps", "10", "--lr=0.0003"]] * 2
    seeds = [a[3] for a in args]
    assert seeds[:2] == seeds[2:] and all(s.startswith("--seed=") and s[7:].isdigit() for s in seeds)
    again = load_sweep(path, script=TRAIN, script_args=["--steps", "3"])
    assert again.configs[0].script.args[:2] == ["--steps", "3"] and again.sweep_id != sweep.sweep_id


def cli(*argv: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([DIGITS, "script.args.lr=1,2"], "'script.args.lr' is a script argument, but the sweep runs no script"),
        (["--script", TRAIN, "script.args.lr=1,2", "--", "--lr", "3"], "is also in the script's fixed arguments"),
        (["--script", TRAIN, "script.args.l.r=1,2"], "'l.r' is not an option name"),
        (["--script", TRAIN, "script.args.l r=1,2"], "sweep key 'script.args.l r' is not script.args.NAME"),
        (["--script", TRAIN, "script.arg_style=hydra", "script.args.lr=1,2", "--", "+lr=3"], "('+lr=3')"),
        (["--script", TRAIN, "script.arg_style=argparse", "script.args.lr=1,2"], "'script.arg_style' = 'argparse'"),
        (["--script", "nope.py", "script.args.lr=1,2"], "config key 'script.path' = 'nope.py': "),
        (["--script", TRAIN, "script.args.lr=1,2", "optim.lr=0.1"], "optim.* applies to the built-in trainer"),
        (["--script", TRAIN, "script.args.lr=1,2", "script.path=x.py"], "sweep key 'script.path' is given twice"),
        ([f"script.path={TRAIN},null"], "sweep mixes trials that run a script with trials"),
        (["script.args.lr=1,2"], "no config given"),
        (["--script", TRAIN, "script.args.lr=1,1"], "sweep trials 0 and 1 are the same config"),
    ],
    ids=["no_script", "clash", "dotted_name", "space_in_name", "hydra_clash", "style", "missing_script",
         "trainer_key", "script_twice", "mixed", "nothing", "duplicate"],
)  # fmt: skip
def test_bad_script_sweeps_fail_in_one_line_before_anything_exists(tmp_path, monkeypatch, argv, message):
    code, out, err = cli("sweep", *argv, "--dry-run", "--no-cluster-check", cwd=tmp_path, monkeypatch=monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0] and "(hint: " in lines[0], err
    assert not out and not list(tmp_path.iterdir())


def test_dry_run_lists_each_trials_argv_and_the_script_entry(tmp_path):
    proc = run_cli("sweep", "--script", TRAIN, "script.args.lr=0.1,0.2", "script.args.sleep=0,0.01", QUIET,
                   "--dry-run", "--no-cluster-check", "--", "--steps", "10", "--crash-once", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = [line.split("runs: ", 1)[1] for line in proc.stdout.splitlines() if "runs: " in line]
    assert runs == [
        f"{TRAIN} --steps 10 --crash-once --lr={lr} --sleep={s}" for lr in ("0.1", "0.2") for s in ("0", "0.01")
    ]
    assert "each task runs ddp_core.script.run(RUN_DIR) on its trial's run directory" in proc.stdout
    assert "-m ddp_core.cluster.entry" in proc.stdout and "#SBATCH --array=0-3%" in proc.stdout
    assert not list(tmp_path.iterdir())  # a dry run creates nothing


# --- the array, with sbatch faked (the Slurm gateway's answer); the trials run for real -----------------------------


class FakeGateway:
    """The Slurm gateway of a cluster that queues whatever it is given as job 900 and runs nothing: what was queued
    is read back from the job's folder, as submitit's job entry on a node would read it."""

    def queued_from(self, folder: Path) -> list[str]:
        return []

    def max_array_size(self) -> int:
        return 1001

    def squeue_ids(self, ids: Sequence[str], strict: bool = False) -> list[tuple[str, str]]:
        return []

    def sbatch(self, script: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(["sbatch", str(script)], 0, "Submitted batch job 900\n", "")


def run_trial(run: Path, log_dir: Path, job_id: str) -> int:
    """Rank 0 of one attempt, as an array task runs it: stderr appended to submitit's per-task log file."""
    log = log_dir / f"{job_id}_0_log.err"
    with open(log, "a") as err, open(log_dir / f"{job_id}_0_log.out", "a") as out:
        return subprocess.run([sys.executable, "-m", "ddp_core.script", str(run)], stdout=out, stderr=err,
                              env=clean_env(), cwd=ROOT, timeout=120).returncode  # fmt: skip


@pytest.fixture(scope="module")
def ran_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-trial sweep submitted through submit_sweep (executor faked), each trial then run twice by hand: its
    first attempt crashes halfway (--crash-once), its second completes."""
    root = tmp_path_factory.mktemp("sweep")
    spec = load_sweep(None, ["script.args.lr=0.1,0.2", QUIET, f"run.root={root}"], name="lrs", script=TRAIN,
                      script_args=["--steps", "20", "--crash-once"])  # fmt: skip
    request = sw.check_sweep(spec, local_check=False)
    from submitit.core.utils import DelayedSubmission

    from ddp_core.script.mode import run as script_run
    from jobs.submission import submit

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sw, "GATEWAY", FakeGateway())
        mp.setattr(submit, "GATEWAY", FakeGateway())
        arrays = sw.submit_sweep(spec, sw.plan(spec), parallelism=2, request=request)
        assert arrays == ["900"]
        folder = sw.sweep_dir(spec) / "slurm"
        assert "#SBATCH --array=0-1%2" in (folder / "900_submission.sh").read_text()
        calls = [DelayedSubmission.load(folder / f"900_{i}_submitted.pkl") for i in range(2)]
        # jobs.submission.submit.task_function's choice for a script, as for one submitted run, on each trial's run
        assert [c.function for c in calls] == [script_run, script_run]
        for i, call in enumerate(calls):
            assert run_trial(Path(call.args[0]), folder, f"900_{i}") == 1  # crashed once
            assert run_trial(Path(call.args[0]), folder, f"900_{i}") == 0
        assert {p.action for p in sw.plan(spec)} == {"completed"}  # the same sweep again submits nothing
    return sw.sweep_dir(spec)


def test_trials_record_their_arguments_and_events(ran_sweep):
    meta = json.loads((ran_sweep / "sweep.json").read_text())
    assert meta["base_config"] is None and meta["arrays"][0]["job_id"] == "900"
    for trial in trials_of(ran_sweep):
        cfg = RunDir(trial).load_config()
        lr = cfg.script.args[-1]
        assert cfg.script.path == TRAIN and cfg.script.args == ["--steps", "20", "--crash-once", lr]
        assert lr in ("--lr=0.1", "--lr=0.2") and cfg.wandb.group == "lrs"
        seen = [e for e in events(trial) if e["event"] != "rank_failed"]  # the crash's own record aside
        assert [e["event"] for e in seen] == ["start", "start", "completed"]
        assert [e["step"] for e in seen] == [None, None, 20]  # a start has no step; completed: the last logged
        code = json.loads((trial / "code.json").read_text())  # one snapshot for the whole sweep, the script's folder
        assert code["path"] == str(ran_sweep / "code") and code["source"] == str(Path(TRAIN).parent)
        assert (ran_sweep / "code" / Path(TRAIN).name).is_file() and not (trial / "code").exists()
        out = "".join(p.read_text() for p in (ran_sweep / "slurm").glob("900_*_0_log.out"))
        assert f"argv ['--steps', '20', '--crash-once', '{lr}']" in out


def test_status_shows_each_trials_script_and_last_step(ran_sweep):
    fake = FakeSlurm(sacct="900_0|901|COMPLETED|0:0|a|b\n900_1|902|COMPLETED|0:0|a|b")
    text, active = status.status_text(str(ran_sweep), "min:train/loss", runner=fake)
    header, *rows = text.splitlines()
    assert header.split()[:10] == [
        "JOB",
        "STATE",
        "RESTARTS",
        "RANKS",
        "STEP",
        "LOSS",
        "train/loss",
        "CHECKPOINT",
        "SCRIPT",
        "RUN",
    ]
    assert len(rows) == 3 and not active  # two trials, then the best line
    for row in rows[:2]:
        assert "COMPLETED" in row and " 20 " in row
        assert "script_sweep_train.py … " in row and " --crash-once --lr=0." in row  # the end: a sweep's own
    # lr 0.2 falls faster: (1 - 2 lr)^40 is the smaller loss, and the best trial is the first row
    assert rows[0].startswith("*") and "--lr=0.2" in rows[0] and rows[2].startswith("* best by min:train/loss")
    assert fake.calls[0][-1] == "900"  # one sacct call, by the array's id


def test_script_label_keeps_the_arguments_end():
    assert status.script_label(None) == "-"
    assert status.script_label(["-m", "pkg.train", "--lr=1", "a b"]) == "-m pkg.train --lr=1 'a b'"
    long = status.script_label(["/x/train.py", *[f"--k{i}=v" for i in range(20)]])
    assert len(long) <= status.SCRIPT_WIDTH and long.startswith("train.py … ") and long.endswith(" --k19=v")


def test_logs_split_a_script_runs_attempts(ran_sweep):
    trial = trials_of(ran_sweep)[0]
    out = io.StringIO()
    logs.show(RunDir(trial), 0, "err", "all", out)
    text = out.getvalue()
    assert "--- attempt 1 of 2 ---" in text and "--- attempt 2 of 2 ---" in text
    first, second = text.split("--- attempt 2 of 2 ---")
    assert "RuntimeError: crashing once on purpose" in first and "crashing once" not in second
    assert "INFO ddp_core.script: single on " in second  # each attempt starts with the launcher's rank banner


def test_report_draws_what_runtime_log_wrote(ran_sweep, tmp_path):
    png, page = write_report(ran_sweep, tmp_path, metric="min:train/loss")
    html = page.read_text()
    curves = report_figures(html)["curve-train/loss"]["data"]
    assert sorted(t["name"] for t in curves) == ["lr=0.1", "★ lr=0.2"]  # a curve per trial, named by its argument
    assert "<th>script.args.lr</th>" in html  # the swept column: each trial's own argument
    assert png.stat().st_size > 10_000
    for trial in trials_of(ran_sweep):  # runtime.log's records are the trainer's MetricsLog records
        records = RunDir(trial).metrics()
        assert [r["step"] for r in records] == [5, 10, 15, 20]  # the crashed attempt's 5, 10 rewound
        assert all(set(r) == {"step", "time", "split", "loss"} and r["split"] == "train" for r in records)


def plain_run(tmp_path: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run of a plain script (no ddp_core.runtime), as `ddpjob submit --script` would prepare and run it."""
    path = tmp_path / "plain.py"
    path.write_text(body)
    code, out, err = cli("prepare", "--script", str(path), "--no-cluster-check", QUIET, cwd=tmp_path,
                         monkeypatch=monkeypatch)  # fmt: skip
    assert code == 0, err
    run = Path(out.strip())
    RunDir(run).record_job("4242", "submitit")
    assert run_trial(run, run / "slurm", "4242") == 0
    return run


def test_status_logs_and_report_of_a_plain_script_run(tmp_path, monkeypatch):
    run = plain_run(tmp_path, "print('plain script done', flush=True)\n", monkeypatch)
    assert [(e["event"], e["step"]) for e in events(run)] == [("start", None), ("completed", None)]
    text, _ = status.status_text(str(run), "eval/accuracy", runner=FakeSlurm(sacct="4242|4242|COMPLETED|0:0|a|b"))
    row = text.splitlines()[1].split()
    # RANKS 1: one attempt of one process; STEP -: the script never said one
    assert row[:5] == ["4242", "COMPLETED", "0", "1", "-"] and "plain.py" in row
    code, out, err = cli("logs", str(run), cwd=tmp_path, monkeypatch=monkeypatch)
    assert code == 0 and "==> job 4242" in out and "ddp_core.script: running " in out, err
    code, out, err = cli("report", str(run), "--out", str(tmp_path / "report"), cwd=tmp_path, monkeypatch=monkeypatch)
    assert code == 0, err
    assert "no metrics yet" in (tmp_path / "report" / "report.html").read_text()


def test_drill_takes_a_null_step_as_none(ran_sweep):
    trial = trials_of(ran_sweep)[0]
    assert drill._step(events(trial)[0]) is None and drill._step({"step": True}) is None
    d = drill.Drill(RunDir(trial).load_config(), RunDir(trial), "900_0", gateway=None)  # type: ignore[arg-type]
    assert d.trained_past(None)["step"] == 5 and d.trained_past(15)["step"] == 20 and d.trained_past(20) is None
    table = drill.render_timings([drill.Timing("the warning signal", None, 0.5, None, 1.5)])
    assert "step -" in table.splitlines()[1]
