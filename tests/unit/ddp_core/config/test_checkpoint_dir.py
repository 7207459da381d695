"""checkpoint.dir: the values the login node refuses (one line naming the key), and where a run's checkpoints go."""

from pathlib import Path

import pytest

from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("relative/ckpt", "must be absolute"),
        ("/a/../b", "no '..'"),
        ("s3://KEY:s3cr3t@bucket/p", "no user, password"),
        ("s3://bucket/p?access_key=s3cr3t", "no user, password"),
        ("s3:///p", "names no bucket"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(value, why):
    with pytest.raises(DdpJobError) as err:
        load_config(None, ["run.name=t", f"checkpoint.dir={value}"])
    assert err.value.message.startswith("config key 'checkpoint.dir'") and why in err.value.message
    assert "s3cr3t" not in str(err.value)


def test_script_mode_keeps_its_own_checkpoints():
    with pytest.raises(DdpJobError, match="script mode's script writes its own checkpoints"):
        load_config(None, ["run.name=t", "checkpoint.dir=s3://bucket/p", "script.path=/bin/true"])


def test_each_run_and_trial_has_its_own_folder_under_checkpoint_dir(tmp_path):
    run = RunDir(tmp_path / "runs" / "demo-20261128-081500-ab12")
    trial = RunDir(tmp_path / "sweeps" / "lr-20261128-081500-cd34" / "t0003")
    assert run.checkpoint_location(None) == run.path / "checkpoints"
    assert run.checkpoint_location("s3://b/pre/") == "s3://b/pre/demo-20261128-081500-ab12"
    assert trial.checkpoint_location("s3://b/pre") == "s3://b/pre/lr-20261128-081500-cd34/t0003"
    assert run.checkpoint_location("/scratch/c") == Path("/scratch/c/demo-20261128-081500-ab12")
    cfg = load_config(None, ["run.name=t", "checkpoint.dir=s3://b/pre"])
    run.initialize(cfg)
    assert run.recorded_checkpoints() == "s3://b/pre/demo-20261128-081500-ab12"
    RunDir(tmp_path / "plain").initialize(load_config(None, ["run.name=t"]))
    assert RunDir(tmp_path / "plain").recorded_checkpoints() == tmp_path / "plain" / "checkpoints"
