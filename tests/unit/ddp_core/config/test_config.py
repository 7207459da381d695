"""Config loading and validation: every user mistake is one DdpJobError naming the key."""

import re
import subprocess
import sys

import pytest

from ddp_core.config import Config, Precision, load_config, load_saved, to_yaml
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"


def test_example_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert isinstance(load_config(path), Config), path


def test_overrides_apply_and_convert():
    cfg = load_config(DIGITS, ["optim.lr=3e-4", "train.precision=bf16", "task.model.hidden=64", "wandb.tags=[a,b]"])
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.train.precision is Precision.bf16
    assert cfg.task.model["hidden"] == 64
    assert cfg.wandb.tags == ["a", "b"]


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(DIGITS, ["train.max_steps=70"])
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(saved) == cfg == load_saved(saved)


def test_a_run_directory_config_is_read_without_omegaconf_unless_hand_edited(tmp_path):
    cfg = load_config(DIGITS, ["train.max_steps=70", "wandb.tags=[a,'1e3']", "optim.min_lr=1e-6"])
    run = RunDir(tmp_path / "run")
    run.initialize(cfg)
    code = (f"import sys; from pathlib import Path; from ddp_core.run.rundir import RunDir; "
            f"cfg = RunDir(Path({str(run.path)!r})).load_config(); "
            "print(cfg.train.max_steps, cfg.wandb.tags, cfg.optim.min_lr, 'omegaconf' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["70", "['a',", "'1e3']", "1e-06", "False"], out
    # A hand edit in OmegaConf's language is still OmegaConf's to read: an interpolation resolves, a typo is named.
    text = run.config_file.read_text()
    run.config_file.write_text(text.replace("max_steps: 70", "max_steps: ${train.eval_every}"))
    assert run.load_config().train.max_steps == cfg.train.eval_every
    run.config_file.write_text(text.replace("max_steps: 70", "max_stepz: 70"))
    with pytest.raises(DdpJobError, match=r"train\.max_stepz"):
        run.load_config()


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'"),
        ("optim.lr=abc", "bad value for config key 'optim.lr'"),
        ("train.precision=fp8", "train.precision"),
        ("optim.lr", "override 'optim.lr' is not of the form key=value"),
        ("=3", "not of the form key=value"),
        ("train.max_steps=0", "'train.max_steps' = 0 is invalid"),
        ("data.batch_size=-1", "'data.batch_size'"),
        ("optim.warmup_steps=400", "'optim.warmup_steps'"),
        ("task.target=nocolon", "'task.target'"),
        ("run.name=a/b", "'run.name'"),
    ],
)
def test_bad_input_names_the_key(override, needle):
    with pytest.raises(DdpJobError) as err:
        load_config(DIGITS, [override])
    assert needle in str(err.value)
    assert "hint:" in str(err.value)


def test_missing_file_and_missing_value(tmp_path):
    with pytest.raises(DdpJobError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("train:\n  max_steps: 5\n")
    with pytest.raises(DdpJobError, match=r"'run\.name' is required"):
        load_config(cfg_file)


BOMB = "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))
BAD_FILES = {
    "syntax": ("run: {name: x\n  bad: [\n", "is not valid YAML at line 2, column 6: expected ',' or '}'"),
    "duplicate": ("run:\n  name: a\n  name: b\n", "repeats the key 'name' at line 3"),
    "python_tag": ("run: !!python/object:os.system {}\n", "could not determine a constructor for the tag"),
    "not_utf8": (b"\xff\xfe\x00bad", "is not UTF-8 text"),
    "list": ("- a\n- b\n", "holds a list, not a mapping of sections"),
    "alias_bomb": ("a: &a [x, x, x, x, x, x, x, x, x]\n" + BOMB, "expands to more than 100000 values"),
    "python_file": ('"""A module."""\nimport os\n', "is not valid YAML at line 1, column 3"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_unreadable_config_files_are_one_line_errors(tmp_path, case):
    content, needle = BAD_FILES[case]
    path = tmp_path / "bad.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DdpJobError, match=re.escape(needle)):
        load_config(path)
    proc = run_cli("submit", str(path), "--dry-run", "--local", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("ddpjob: error: config file"), proc.stderr


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("optim.momentum=-5", "'optim.momentum' = -5.0 is invalid: must be in [0, 1)"),
        ("data.batch_size=2000000", "'data.batch_size' = 2000000 is invalid: must be at most 1048576"),
        ("train.seed=1180591620717411303424", "'train.seed' = 1180591620717411303424 is invalid"),
        ("optim.lr=inf", "'optim.lr' = inf is invalid: must be a finite number"),
        ("checkpoint.sigterm_budget_s=nan", "'checkpoint.sigterm_budget_s' = nan is invalid: must be a finite"),
        ("checkpoint.sigterm_budget_s=-1", "'checkpoint.sigterm_budget_s' = -1.0 is invalid: must be >= 0"),
        ("slurm.mem_gb=-5", "'slurm.mem_gb' = -5.0 is invalid: must be > 0"),
        ("slurm.time_min=1000000000000", "'slurm.time_min' = 1000000000000 is invalid: must be at most 527040"),
    ],
)
def test_numbers_out_of_range_are_refused(override, needle):
    with pytest.raises(DdpJobError, match=re.escape(needle)):
        load_config(ROOT / "configs" / "digits.yaml", [override])


def test_secrets_are_not_interpolated_into_saved_configs(tmp_path):
    with pytest.raises(DdpJobError, match=re.escape("override 'wandb.entity' interpolates ${oc.env:WANDB_API_KEY}")):
        load_config(DIGITS, ["wandb.entity=${oc.env:WANDB_API_KEY}"])
    config = tmp_path / "c.yaml"
    config.write_text("run: {name: x}\nwandb: {entity: '${oc.env:MY_TOKEN,none}'}\n")
    with pytest.raises(DdpJobError, match=re.escape("interpolates ${oc.env:MY_TOKEN}, which looks like a secret")):
        load_config(config)
    assert load_config(DIGITS, ["run.root=${oc.env:HOME}/runs"]).run.root.endswith("/runs")  # not a secret


def test_the_node_local_tier_is_refused_in_script_mode():
    with pytest.raises(DdpJobError, match=re.escape("'checkpoint.local_every_steps' is set, but the node-local tier")):
        load_config(None, ["run.name=s", "script.path=/work/train.py", "checkpoint.local_every_steps=10"])
    assert load_config(None, ["run.name=s", "script.path=/work/train.py"]).checkpoint.local_every_steps == 0
