"""Damaged run directories (a full disk, a killed writer, a careless edit): ``status``, ``logs``, ``cancel`` and
``report`` either work around the damage with a warning or stop with one ``ddpjob: error:`` line; never a traceback.
(Damaged checkpoints are skipped by ``find_latest``: tests/unit/ddp_core/checkpoint/test_checkpoint.py.)"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobs.cli import main
from tests.support.fuzz import fuzz
from tests.support.helpers import ROOT

# The keys the readers look for, so random records reach their field checks instead of being skipped whole.
KEYS = ["jobs", "job_id", "via", "log_dir", "submitted", "event", "step", "split", "loss", "time", "t", "run_id",
        "file", "size", "sha256", "checksum", "digest", "kind", "summary", "save_s", "write_s"]  # fmt: skip
FILES = ["config.yaml", "run.json", "attempts.jsonl", "metrics.jsonl", "checkpoints/step_00000020.json"]
DAMAGE = {
    "truncated": lambda data: data[: len(data) // 2],
    "null": lambda _: b"null",
    "list": lambda _: b"[1, {}]",
    "binary": lambda _: b"\xff\xfe\x00\x01garbage",
    "empty": lambda _: b"",
    "fields": lambda _: b'{"jobs": [{"via": 3}, 7], "job_id": [], "event": 1, "step": "x", "split": 2}\n',
    "directory": None,
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real run of 20 steps, with a submitted job recorded as `ddpjob submit` would."""
    run = tmp_path_factory.mktemp("base") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))} | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ddp_core", str(ROOT / "configs" / "digits.yaml"), "--run-dir", str(run),
           "train.max_steps=20", "checkpoint.every_steps=10", "train.eval_every=10", "optim.warmup_steps=2",
           "wandb.mode=disabled"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=120)
    meta = json.loads((run / "run.json").read_text())
    meta["jobs"] = [{"job_id": "4242", "via": "submitit", "log_dir": str(run / "slurm")}]
    (run / "run.json").write_text(json.dumps(meta))
    return run


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_damaged_run_files_give_a_warning_or_one_error_line(finished_run, tmp_path, capsys, caplog, name, damage):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    target = run / name
    if DAMAGE[damage] is None:
        target.unlink()
        target.mkdir()
    else:
        target.write_bytes(DAMAGE[damage](target.read_bytes()))
    commands = [["status", str(run)], ["status", str(tmp_path)], ["logs", str(run)], ["cancel", str(run)],
                ["report", str(run), "--out", str(tmp_path / "report")]]  # fmt: skip
    for argv in commands:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            code = main(argv)  # any exception fails the test: that is the traceback a user would see
        err = capsys.readouterr().err.strip()
        if code == 2:
            assert len(err.splitlines()) == 1 and err.startswith("ddpjob: error: "), (argv, err)
        else:
            assert code == 0 or (argv[0] == "logs" and "no rank 0 err log" in err), (argv, code, err)
        readers = {"attempts.jsonl": ("status",), "metrics.jsonl": ("status", "report")}.get(name, ())
        if code == 0 and damage == "directory" and argv[0] in readers:
            assert f"skipping {target}" in caplog.text, (argv, caplog.text)  # the damage is reported, not hidden


def test_status_over_many_runs_skips_a_damaged_one(finished_run, tmp_path, capsys, caplog):
    for name in ("a", "b"):
        shutil.copytree(finished_run, tmp_path / name)
    (tmp_path / "a" / "run.json").write_text('{"run_id": "ab')
    with caplog.at_level(logging.WARNING):
        assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "b") in out and str(tmp_path / "a") not in out, out
    assert f"skipping {tmp_path / 'a'}: {tmp_path / 'a' / 'run.json'} is unreadable" in caplog.text


JSON_LIKE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip


@fuzz(15)
@given(
    name=st.sampled_from(FILES),
    content=st.binary(max_size=200)
    | JSON_LIKE.map(lambda v: json.dumps(v).encode())
    | st.lists(JSON_LIKE, max_size=4).map(lambda vs: "\n".join(json.dumps(v) for v in vs).encode()),
)
def test_any_bytes_in_a_run_file_never_give_a_traceback(finished_run, tmp_path_factory, name, content):
    """Property: whatever a run file holds (random bytes, JSON of any shape, JSON lines of any shape, with the
    keys the readers look for), status, logs, cancel and report give a result or one error line."""
    run = tmp_path_factory.mktemp("fuzz") / "run"
    shutil.copytree(finished_run, run)
    (run / name).write_bytes(content)
    for argv in (["status", str(run)], ["logs", str(run)], ["cancel", str(run)],
                 ["report", str(run), "--out", str(run.parent / "report")]):  # fmt: skip
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        text = err.getvalue().strip()
        if code == 2:
            assert len(text.splitlines()) == 1 and text.startswith("ddpjob: error: "), (argv, text)
        else:
            assert code == 0 or (argv[0] == "logs" and "no rank 0 err log" in text), (argv, code, text)
