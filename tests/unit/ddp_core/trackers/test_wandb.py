"""W&B from the trainer without a W&B server: an unreachable one falls back to an offline record under the run's id,
and offline records of a stopped and resumed run continue one W&B run. (Online without an API key:
tests/unit/ddp_core/trainer/test_trainer.py; offline across Slurm requeues: tests/cluster/test_preemption.py.)"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from tests.support.helpers import ROOT, events, run_trainer, wandb_records

DIGITS = str(ROOT / "configs" / "digits.yaml")
QUICK = ["train.eval_every=0", "optim.warmup_steps=5", "train.log_every=5", "checkpoint.every_steps=10",
         "train.max_steps=20"]  # fmt: skip


def no_account(home: Path) -> dict[str, str]:
    """No W&B settings or credentials from the machine running the tests."""
    return {"HOME": str(home), "WANDB_API_KEY": ""}


def history_steps(run_dir: Path) -> dict[str, list[int]]:
    """Each offline record folder of a run (in the order wandb sync takes them) and the steps of its history,
    asserting that every record belongs to the run's W&B id."""
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    out = {}
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        assert folder.name.endswith(f"-{run_id}"), folder
        record_file = folder / f"run-{run_id}.wandb"
        assert record_file.stat().st_size > 0
        steps: list[int] = []
        for record in wandb_records(record_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id
            elif kind == "history" and record.history.step.num not in steps[-1:]:
                steps.append(record.history.step.num)  # one step's train, eval, checkpoint metrics: one entry
        out[folder.name] = steps
    return out


def test_an_unreachable_server_falls_back_to_an_offline_record_of_the_same_run(tmp_path):
    with socket.socket() as closed:  # bound, never listening: connections are refused, and no one else gets it
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        # A well-formed key, so the init really asks the server (without one it fails before: test_trainer.py).
        env = no_account(tmp_path) | {"WANDB_BASE_URL": url, "WANDB_API_KEY": "0" * 40, "WANDB_INIT_TIMEOUT": "5"}
        log = run_trainer(DIGITS, tmp_path / "run", [*QUICK, "wandb.mode=online"], env=env)
    assert "finished at step 20" in log
    warnings = [line for line in log.splitlines() if "WARNING ddp_core.trackers.wandb_run" in line]
    assert len(warnings) == 1, log  # one line: not "is in use", not "disabled"
    assert "W&B online init failed (CommError: " in warnings[0] and url in warnings[0]
    assert f"logging offline instead: upload later with `ddpjob sync {tmp_path / 'run'}`" in warnings[0]
    run_id = json.loads((tmp_path / "run" / "run.json").read_text())["run_id"]
    assert f"W&B run {run_id} (offline)" in log
    assert list(history_steps(tmp_path / "run").values()) == [[5, 10, 15, 20]]  # every logged step


def test_offline_records_of_a_stopped_and_resumed_run_continue_its_run(tmp_path):
    run = tmp_path / "run"
    signalled = [*QUICK, "wandb.mode=offline", "task.target=tests.support.tasks:SignalledDigitsTask"]
    run_trainer(DIGITS, run, signalled, env=no_account(tmp_path) | {"DDPJOB_TEST_SIGNAL_AT": "0:12"}, stopped=True)
    stopped = events(run, "interrupted")[0]["step"]
    assert 10 < stopped < 15, stopped
    run_trainer(str(run), run, [], env=no_account(tmp_path))
    # One record per attempt, both of the run's id; the second goes on after the stop checkpoint's step.
    assert list(history_steps(run).values()) == [[5, 10, stopped], [15, 20]]
