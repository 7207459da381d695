"""The one guard for secrets (ddp_core.config.secrets): every spelling of a secret in a config or a setup line is
refused in one line naming the key and where the secret belongs; the safe values next to them are accepted."""

from __future__ import annotations

import pytest

from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from jobs.remote import hosts
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"
KEY_VALUE = "0123456789abcdef0123456789abcdef"  # a W&B key's shape


def refused(overrides: list[str], *parts: str, text: str | None = None, tmp_path=None) -> str:
    with pytest.raises(DdpJobError) as err:
        if text is None:
            load_config(DIGITS, overrides)
        else:
            path = tmp_path / "c.yaml"
            path.write_text(text)
            load_config(path, overrides)
    line = str(err.value)
    assert "\n" not in line and all(p in line for p in parts), line
    return line


@pytest.mark.parametrize(
    "spelling",
    [
        "${oc.env:WANDB_API_KEY}",
        "${oc.env:'WANDB_API_KEY'}",
        '${oc.env:"WANDB_API_KEY"}',
        "${ oc.env : WANDB_API_KEY }",
        "${oc.env:'WANDB_API_KEY',none}",
        "${env:WANDB_API_KEY}",
        "x-${oc.decode:'${oc.env:HF_TOKEN}'}",
    ],
)
def test_every_spelling_of_a_secret_env_interpolation_is_refused(spelling, tmp_path):
    name = "HF_TOKEN" if "HF_TOKEN" in spelling else "WANDB_API_KEY"
    quoted = spelling.replace('"', '\\"')  # a YAML double-quoted string: spaces and braces stay a string
    refused([f'wandb.entity="{quoted}"'], f"override 'wandb.entity' interpolates ${{oc.env:{name}}}", "environment")
    # In a file too: a double-quoted YAML string's \u escape spells the same name.
    escaped = quoted.replace("API", "\\u0041PI").replace("TOKEN", "T\\u004fKEN")
    refused([], f"interpolates ${{oc.env:{name}}}", text=f'run: {{name: x}}\nwandb: {{entity: "{escaped}"}}\n',
            tmp_path=tmp_path)  # fmt: skip


@pytest.mark.parametrize(
    "name", ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD", "HF_TOKEN", "MY_DB_PASSWD"]
)
def test_each_known_secret_name_is_refused(name):
    refused([f"wandb.group=${{oc.env:{name}}}"], f"${{oc.env:{name}}}", f"leave {name} in the environment")


def test_a_computed_variable_name_is_refused_and_plain_ones_are_accepted():
    refused(["wandb.group=${oc.env:${run.name}}"], "whose name is itself interpolated", "write the variable's name")
    refused(["wandb.group=${oc.env:WANDB_${run.name}}"], "whose name is itself interpolated")
    cfg = load_config(DIGITS, ["run.root=${oc.env:HOME}/runs", "wandb.group=${oc.env:'USER',nobody}"])
    assert cfg.run.root.endswith("/runs") and cfg.wandb.group


def test_a_secret_value_that_reached_the_config_anyhow_is_refused(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", KEY_VALUE)
    monkeypatch.setenv("SOME_VALUE", KEY_VALUE)  # an innocent name with the same value: the resolver gets through
    refused(["wandb.group=${oc.env:SOME_VALUE}"], "config key 'wandb.group' holds the value of $WANDB_API_KEY",
            "set WANDB_API_KEY in the job's environment, not the config")  # fmt: skip
    refused([f"task.data.note=a{KEY_VALUE}b"], "config key 'task.data.note' holds the value of $WANDB_API_KEY")
    monkeypatch.setenv("WANDB_API_KEY", "1")  # too short to mean anything: values like 1 or true are everywhere
    assert load_config(DIGITS, ["wandb.group=1"]).wandb.group == "1"
    monkeypatch.setenv("TOKENIZER_DIR", "/data/tokenizers/gpt2")  # a tokenizer's folder is no secret
    cfg = load_config(DIGITS, ["task.data.tokenizer=${oc.env:TOKENIZER_DIR}"])
    assert cfg.task.data["tokenizer"] == "/data/tokenizers/gpt2"


@pytest.mark.parametrize(
    ("key", "url"),
    [
        ("log.mlflow.tracking_uri", "postgresql://user:secret@db.example.edu/mlflow"),
        ("log.mlflow.tracking_uri", "https://token@mlflow.example.edu"),
        ("log.mlflow.tracking_uri", "https://mlflow.example.edu/?api_key=abc"),
        ("log.tensorboard.dir", "s3://AKIA:wJalr@bucket/logs"),
        ("task.data.url", "https://u:p@data.example.edu/set.tar"),
    ],
)
def test_credentials_in_any_url_valued_key_are_refused(key, url):
    refused([f"{key}={url}"], f"config key '{key}' has credentials in its URL", f"drop them from {key}")


def test_checkpoint_dir_refuses_them_with_the_same_rule():
    refused(["checkpoint.dir=s3://AKIA:wJalr@bucket/ckpt"], "checkpoint.dir", "no user, password")


def test_urls_without_credentials_are_accepted():
    cfg = load_config(DIGITS, ["log.mlflow.tracking_uri=postgresql://db.example.edu/mlflow",
                               "log.tensorboard.dir=s3://bucket/logs", "checkpoint.dir=s3://bucket/ckpt",
                               "task.data.url=https://example.edu/a@b.tar?version=2"])  # fmt: skip
    assert cfg.log.mlflow.tracking_uri == "postgresql://db.example.edu/mlflow"


@pytest.mark.parametrize(
    "line",
    [
        "export WANDB_API_KEY=0123abcd",
        "export A=1 HF_TOKEN='hf_abc'",
        "AWS_SECRET_ACCESS_KEY=wJalr python -c pass",
        'declare -x MLFLOW_TRACKING_PASSWORD="pw"',
        "true; AWS_SESSION_TOKEN=abc",
        "setenv WANDB_API_KEY 0123abcd",
    ],
)
def test_a_literal_secret_in_slurm_setup_is_refused(line):
    name = next(n for n in ("WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD",
                            "AWS_SESSION_TOKEN") if n in line)  # fmt: skip
    refused([f"slurm.setup=[{line!r}]"], "config key 'slurm.setup[0]' sets", name,
            f"set {name} in the job's environment, not the config")  # fmt: skip


def test_setup_lines_that_read_a_secret_from_elsewhere_are_accepted():
    lines = ["export HF_TOKEN=$(cat ~/.hf_token)", 'export WANDB_API_KEY="$MY_KEY"', "module load cuda",
             "export KEYBOARD_LAYOUT_DIR_OK", "python train.py --api-key-file=~/.key"]  # fmt: skip
    cfg = load_config(DIGITS, [f"slurm.setup=[{', '.join(repr(line) for line in lines)}]"])
    assert cfg.slurm.setup == lines


def test_the_host_files_setup_line_takes_the_same_guard(tmp_path, monkeypatch):
    path = tmp_path / "hosts.yaml"
    monkeypatch.setenv(hosts.HOSTS_ENV, str(path))
    path.write_text("big:\n  setup: module load python && export WANDB_API_KEY=0123abcd\n")
    with pytest.raises(DdpJobError) as err:
        hosts.lookup("big")
    line = str(err.value)
    assert "big.setup sets WANDB_API_KEY" in line and "$(cat ~/.wandb_api_key)" in line and "\n" not in line, line
    path.write_text("big:\n  setup: module load python && export WANDB_API_KEY=$(cat ~/.wandb_key)\n")
    assert hosts.lookup("big").setup.endswith("$(cat ~/.wandb_key)")
