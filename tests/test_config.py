"""Config loading and validation: every user mistake is one DdpJobError naming the key."""

from pathlib import Path

import pytest

from ddp_core.config import Config, Precision, load_config, to_yaml
from ddp_core.errors import DdpJobError

ROOT = Path(__file__).resolve().parent.parent
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
    assert load_config(saved) == cfg


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
