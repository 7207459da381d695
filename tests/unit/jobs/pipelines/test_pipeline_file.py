"""Pipeline files (jobs.pipelines.spec, jobs.pipelines.launch): every step checked before any is submitted, each
refusal one line naming the step; the order steps go in; what a rerun keeps, waits for or skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_core.errors import DdpJobError
from jobs.pipelines import launch, record, spec
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT

DIGITS = str(ROOT / "configs" / "digits.yaml")
SCRIPT = str(ROOT / "examples" / "pipeline" / "export_best.py")


def write(tmp_path: Path, steps: dict, **top: object) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({**top, "steps": steps}))  # JSON is YAML
    return path


def test_steps_go_after_what_they_wait_for_else_in_the_files_order(tmp_path):
    steps = {"export": {"script": SCRIPT, "after": ["train:any"]}, "prepare": {"script": SCRIPT},
             "train": {"config": DIGITS, "after": "prepare"},
             "report": {"script": SCRIPT, "after": "prepare:notok"}}  # fmt: skip
    pipe = spec.load(write(tmp_path, steps))
    assert [s.name for s in pipe.steps] == ["prepare", "train", "export", "report"]
    assert pipe.name == "p" and pipe.folder == Path("runs/pipelines/p")
    assert pipe.upstream("export") == {"train", "prepare"} and pipe.step("export").after[0].mode == "any"


@pytest.mark.parametrize(
    ("steps", "needle"),
    [
        ({"a": {"script": SCRIPT, "after": "b"}, "b": {"script": SCRIPT, "after": "c"}, "c": {"script": SCRIPT,
          "after": "a"}}, "steps a -> b -> c -> a form a cycle"),
        ({"a": {"script": SCRIPT, "after": "nope"}}, "step 'a': after 'nope': no such step"),
        ({"a": {"script": SCRIPT, "after": "a"}}, "step 'a': a step cannot run after itself"),
        ({"a": {"script": SCRIPT, "after": "a:sometimes"}}, "unknown condition 'sometimes'"),
        ({"a": {"overrides": ["x=1"]}}, "step 'a': a step needs a config or a script"),
        ({"a": {"config": DIGITS, "args": ["--x"]}}, "'args' are a script's arguments"),
        ({"a": {"config": DIGITS, "overides": []}}, "step 'a': unknown key 'overides'"),
        ({"a": {"config": DIGITS, "overrides": "x=1"}}, "'overrides' must be a list of strings"),
        ({"a b": {"config": DIGITS}}, "a step's name is letters, digits"),
        ({}, "'steps' must map each step's name"),
    ],
)  # fmt: skip
def test_a_bad_file_is_one_line_naming_the_step(tmp_path, steps, needle):
    with pytest.raises(DdpJobError, match=needle.replace("(", r"\(")) as err:
        spec.load(write(tmp_path, steps))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["${steps.nope.run_dir}"], r"\$\{steps.nope.run_dir\}: no step 'nope'"),
        (["${steps.train.weights}"], "unknown field 'weights'"),
        (["${steps.side.run_dir}"], "'side' is not a step this one runs after"),
        (["${steps.train}"], r"'\$\{steps.train\}' is not a reference"),
    ],
)
def test_references_name_an_earlier_step_and_a_field(tmp_path, args, needle):
    steps = {"train": {"config": DIGITS}, "side": {"script": SCRIPT},
             "export": {"script": SCRIPT, "args": args, "after": "train"}}  # fmt: skip
    pipe = spec.load(write(tmp_path, steps))
    with pytest.raises(DdpJobError, match=needle):
        launch.load_step(pipe, pipe.step("export"), cluster=False, folder=tmp_path)


def test_references_in_keys_used_at_submit_are_refused(tmp_path):
    steps = {"train": {"config": DIGITS}, "use": {"config": DIGITS, "after": "train",
             "overrides": ['slurm.setup=["cd ${steps.train.run_dir}"]']}}  # fmt: skip
    pipe = spec.load(write(tmp_path, steps))
    with pytest.raises(DdpJobError, match=r"config key 'slurm.setup' = \$\{steps.train.run_dir\}: it is used when"):
        launch.load_step(pipe, pipe.step("use"), cluster=False, folder=tmp_path)


def test_references_in_overrides_and_config_files_reach_the_run_unresolved(tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text(
        Path(DIGITS)
        .read_text()
        .replace("project: ddpjob-digits", "project: ddpjob-digits\n  group: '${steps.train.run_dir}'")
    )
    steps = {"train": {"config": DIGITS}, "eval": {"config": str(config), "after": "train",
             "overrides": ['wandb.tags=["${steps.train.best_checkpoint}"]']}}  # fmt: skip
    pipe = spec.load(write(tmp_path, steps))
    prepared = launch.load_step(pipe, pipe.step("eval"), cluster=False, folder=tmp_path)
    assert prepared.cfg.wandb.group == "${steps.train.run_dir}"
    assert prepared.cfg.wandb.tags == ["${steps.train.best_checkpoint}"]
    assert prepared.cfg.run.name == "p-eval"


def test_a_bad_step_config_is_refused_before_anything_is_submitted(tmp_path):
    steps = {"train": {"config": DIGITS}, "eval": {"config": DIGITS, "overrides": ["optim.lr=abc"], "after": "train"}}
    proc = run_cli("pipeline", str(write(tmp_path, steps)), "--no-cluster-check", cwd=tmp_path)
    assert proc.returncode == 2 and "step 'eval': bad value for config key 'optim.lr'" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_rerun_waits_for_kept_steps_and_skips_what_can_no_longer_run():
    export = spec.Step("export", script=SCRIPT, after=(spec.After("train"),))
    report = spec.Step("report", script=SCRIPT, after=(spec.After("train", "notok"),))
    rec = record.Record("p", "p.yaml", {"train": record.Entry("runs/t", "41")})
    assert launch.waits_for(export, rec, {"train": "RUNNING"}) == (["afterok:41"], "")
    assert launch.waits_for(export, rec, {"train": "COMPLETED"}) == ([], "")
    assert launch.waits_for(report, rec, {"train": "COMPLETED"}) == (
        [],
        "train ended COMPLETED, and this step runs after train:notok",
    )
    assert launch.waits_for(export, rec, {}) == (["afterok:41"], "")  # submitted by this command


def test_a_rerun_keeps_completed_steps_and_jobs_that_still_wait_for_kept_ones(tmp_path):
    steps = {"prep": {"script": SCRIPT}, "train": {"config": DIGITS, "after": "prep"},
             "export": {"script": SCRIPT, "after": "train"}, "side": {"script": SCRIPT, "after": "prep"}}  # fmt: skip
    pipe = spec.load(write(tmp_path, steps))
    before = record.Record("p", "p.yaml", {n: record.Entry(f"runs/{n}", str(i)) for i, n in enumerate(steps)})
    # train failed: its waiting dependent (Slurm has not cancelled it yet) goes again, after the new train
    found = {"prep": "COMPLETED", "train": "FAILED(1)", "export": "PENDING", "side": "RUNNING"}
    assert launch.keep(pipe, found, before, fresh=False) == ({"prep": "COMPLETED", "side": "RUNNING"}, ["2"])
    assert launch.keep(pipe, found, before, fresh=True) == ({}, ["2", "3"])


def test_relative_paths_in_a_pipeline_file_are_taken_from_its_folder(tmp_path):
    """The example pipeline, named by its absolute path from another folder: every step's config and script found
    (the dry run checks each step, so a path taken from the current folder would be refused)."""
    example = ROOT / "configs" / "pipelines" / "digits.yaml"
    pipe = spec.load(example)
    assert pipe.step("train").config == str(ROOT / "configs" / "digits.yaml")
    assert pipe.step("prepare").script == str(ROOT / "examples" / "pipeline" / "prepare_digits.py")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli("pipeline", str(example), "--dry-run", "--no-cluster-check", cwd=elsewhere)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "does not exist" not in proc.stdout + proc.stderr
    nested = tmp_path / "project" / "pipelines"
    nested.mkdir(parents=True)
    (nested.parent / "train.yaml").write_text(Path(DIGITS).read_text())
    pipe = spec.load(write(nested, {"train": {"config": "../train.yaml"}, "abs": {"script": SCRIPT}}))
    assert pipe.step("train").config == str(tmp_path / "project" / "train.yaml")
    assert pipe.step("abs").script == SCRIPT
