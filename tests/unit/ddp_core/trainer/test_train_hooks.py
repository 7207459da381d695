"""Task hooks and trainer options beyond the defaults, without Slurm: optimizer groups and schedule floor, train
metrics and grad norm, fp16 with a checkpointed GradScaler, the best checkpoint and early stopping, eval caps,
streaming datasets with mid-epoch resume, and the login-node guard against task modules with side effects."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_core.checkpoint import store as checkpoint
from ddp_core.config import OptimConfig, OptimizerImpl, OptimizerName, Schedule, load_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from ddp_core.tasks.base import Output, TaskConfig, check_task
from ddp_core.trainer.metrics import TrainSums
from ddp_core.trainer.optim import build_optimizer, build_scheduler, keeps_implementation, parameter_groups
from jobs.runs.export import export
from tests.support.helpers import ROOT, events, final_digests, run_trainer

DIGITS = str(ROOT / "configs" / "digits.yaml")
BASE = ["train.eval_every=0", "optim.warmup_steps=5", "train.log_every=10", "checkpoint.every_steps=10",
        "wandb.mode=disabled"]  # fmt: skip


def trainer(run_dir: Path, *overrides: str, nproc: int = 1, stopped: bool = False, env: dict | None = None) -> str:
    return run_trainer(DIGITS, run_dir, overrides, nproc, env, stopped)


def records(run_dir: Path, split: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def truncate(run_dir: Path, after: int) -> None:
    """Delete every checkpoint after step ``after``: as if the job died there."""
    for path in (run_dir / "checkpoints").glob("step_*"):
        if int(path.stem.split("_")[1]) > after:
            checkpoint.remove_data(path)


# --- optimizer and schedule -------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def test_no_decay_patterns_split_the_parameters_into_two_groups():
    model = _Block()
    groups = parameter_groups(OptimConfig(no_decay=["bias", "norm"], weight_decay=0.1), model)
    assert [len(g["params"]) for g in groups] == [1, 3]  # linear.weight decays; linear.bias, norm.* do not
    assert groups[1]["weight_decay"] == 0.0 and groups[0]["params"][0] is model.linear.weight
    opt = build_optimizer(OptimConfig(no_decay=["bias", "norm"], weight_decay=0.1, betas=[0.8, 0.95], eps=1e-6), model)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and opt.param_groups[0]["eps"] == 1e-6


def _trained(name: OptimizerName, impl: OptimizerImpl, steps: int = 30) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = build_optimizer(OptimConfig(name=name, lr=1e-2, weight_decay=0.01, implementation=impl), model)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=data), torch.randint(0, 3, (16,), generator=data)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


@pytest.mark.parametrize("name", list(OptimizerName))
def test_optimizer_implementation_foreach_is_the_for_loop_bit_for_bit_and_outlives_a_resume(name):
    """optim.implementation picks torch.optim's foreach/fused path; the default (foreach) trains bitwise like the
    for-loop torch would take on a CPU, and a checkpoint's saved flags do not override the config's."""
    loop, loop_opt = _trained(name, OptimizerImpl.for_loop)
    for impl in OptimizerImpl:
        model, optimizer = _trained(name, impl)
        assert optimizer.param_groups[0]["foreach"] is (impl is OptimizerImpl.foreach)
        assert optimizer.param_groups[0]["fused"] is (impl is OptimizerImpl.fused)
        pairs = list(zip(loop.parameters(), model.parameters(), strict=True))
        if impl is OptimizerImpl.fused:  # one kernel, its own rounding: close, not equal
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in pairs)
        else:
            assert all(torch.equal(a, b) for a, b in pairs), impl
    # A checkpoint written by the for-loop optimizer, loaded into a foreach one: load_state_dict alone would bring
    # back foreach=False; keeps_implementation keeps the optimizer's own.
    for keep in (False, True):
        _, optimizer = _trained(name, OptimizerImpl.foreach, steps=1)
        with keeps_implementation(optimizer) if keep else contextlib.nullcontext():
            optimizer.load_state_dict(loop_opt.state_dict())
        assert optimizer.param_groups[0]["foreach"] is keep
        loaded, saved = optimizer.state_dict()["state"][0], loop_opt.state_dict()["state"][0]
        assert saved and all(torch.equal(loaded[k], v) for k, v in saved.items())  # the state itself did load


def test_the_schedule_decays_to_min_lr_and_the_default_is_unchanged():
    for schedule in ("cosine", "linear"):
        cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2, schedule=Schedule(schedule))
        sched = build_scheduler(cfg, torch.optim.SGD(_Block().parameters(), lr=1.0), max_steps=20)
        lrs = []
        for _ in range(20):
            lrs.append(sched.get_last_lr()[0])
            sched.optimizer.step()
            sched.step()
        assert lrs[:2] == [0.5, 1.0] and min(lrs[2:]) >= 0.1 - 1e-12
        assert sched.get_last_lr()[0] == pytest.approx(0.1)
    plain = build_scheduler(OptimConfig(lr=1.0), torch.optim.SGD(_Block().parameters(), lr=1.0), max_steps=10)
    for _ in range(10):
        plain.optimizer.step()
        plain.step()
    assert plain.get_last_lr()[0] == 0.0  # min_lr 0: to zero, as before


def test_the_schedule_sets_what_lambdalr_sets_and_loads_its_checkpoints():
    """The built-in schedule is torch's LambdaLR without its per-call checks: the same lr at every step, bitwise, and
    LambdaLR's state dict loads (checkpoints written before it resume)."""
    cfg = OptimConfig(lr=3e-3, min_lr=1e-5, warmup_steps=7, schedule=Schedule.cosine)
    ours = build_scheduler(cfg, torch.optim.SGD(_Block().parameters(), lr=3e-3), max_steps=50)
    theirs = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(_Block().parameters(), lr=3e-3), ours.factor)
    for _ in range(60):  # past max_steps: the floor
        assert ours.get_last_lr() == theirs.get_last_lr()
        ours.optimizer.step()
        theirs.optimizer.step()
        ours.step()
        theirs.step()
    resumed = build_scheduler(cfg, torch.optim.SGD(_Block().parameters(), lr=3e-3), max_steps=50)
    resumed.load_state_dict(theirs.state_dict())
    assert resumed.last_epoch == 60 and resumed.base_lrs == theirs.base_lrs


def test_task_hooks_supply_the_optimizer_and_the_scheduler():
    from ddp_core.tasks.digits import DigitsTask

    class Custom(DigitsTask):
        def configure_optimizer(self, model, cfg):
            return torch.optim.SGD(model.parameters(), lr=cfg.lr * 2)

        def configure_scheduler(self, optimizer, cfg, max_steps):
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    task = Custom()
    opt = build_optimizer(OptimConfig(lr=0.1), _Block(), task)
    sched = build_scheduler(OptimConfig(lr=0.1), opt, 10, task)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.2
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)


# --- train metrics, grad norm ----------------------------------------------------------------------------------------


def test_train_sums_average_exactly_over_samples_and_survive_a_checkpoint():
    sums = TrainSums()
    sums.add(Output(loss=torch.tensor(0.0), count=3, sums={"acc": torch.tensor(2.0)}))
    state = sums.state_dict()  # folds the pending sums, as a checkpoint does
    restored = TrainSums()
    restored.load_state_dict(state)
    for s in (sums, restored):
        s.add(Output(loss=torch.tensor(0.0), count=5, sums={"acc": torch.tensor(5.0)}))
        s.add_grad_norm(torch.tensor(3.0))
        s.add_grad_norm(torch.tensor(1.0))
    line = [s.combine([s.take()]) for s in (sums, restored)]
    assert line[0] == line[1] == {"acc": 7 / 8, "grad_norm": 2.0, "grad_norm_max": 3.0}
    sums.add(Output(loss=torch.tensor(0.0), count=2, sums={}))  # a step without sums adds nothing
    assert sums.combine([sums.take()]) == {"acc": 0.0}  # nothing since the last line: 0 / max(1, 0)


def test_train_metrics_and_grad_norm_are_logged_and_measuring_leaves_the_weights_alone(tmp_path):
    # One process: what is measured is the gradient the optimizer steps on, reduced or not (a pipeline's, whose
    # measurement differs, is the next test's).
    common = [*BASE, "train.max_steps=20", "task.target=tests.support.metric_tasks:TrainMetricsDigitsTask"]
    plain = trainer(tmp_path / "plain", *common)
    assert "grad_norm" not in records(tmp_path / "plain", "train")[0]  # today's default: not measured
    measured = trainer(tmp_path / "measured", *common, "train.log_grad_norm=true")
    assert final_digests(measured) == final_digests(plain)  # the norm is measured without changing a gradient
    lines = records(tmp_path / "measured", "train")
    assert [r["step"] for r in lines] == [10, 20]
    for r in lines:
        assert 0 <= r["accuracy"] <= 1 and r["grad_norm"] > 0 and r["grad_norm_max"] >= r["grad_norm"]
    clipped = trainer(tmp_path / "clipped", *common, "optim.grad_clip=0.5")
    assert final_digests(clipped) != final_digests(plain)
    assert all(r["grad_norm"] > 0 for r in records(tmp_path / "clipped", "train"))


def test_train_metrics_of_a_pipeline_come_from_its_micro_batches_only(tmp_path):
    """The pipeline schedule's first step also scores the whole batch on uninitialised outputs (shape inference):
    only the micro-batches' outputs count, so the logged metrics are finite and match the stage's own losses."""
    trainer(tmp_path / "run", *BASE, "train.max_steps=20",
            "task.target=tests.support.metric_tasks:TrainMetricsDigitsTask", "strategy.name=pipeline",
            "optim.grad_clip=1.0", nproc=2)  # fmt: skip
    for r in records(tmp_path / "run", "train"):
        assert 0 <= r["accuracy"] <= 1 and r["grad_norm"] > 0
        # The task's loss sums over samples give the step losses' mean (equal micro-batches): no foreign term.
        assert r["loss"] == pytest.approx(r["loss_sum_mean"], rel=1e-6)


# --- fp16 --------------------------------------------------------------------------------------------------------


def test_fp16_with_grad_scaler_resumes_bitwise_exactly(tmp_path):
    """CPU autocast to float16 (torch 2.13 supports it) with a GradScaler: its scale is in each checkpoint, and a run
    cut at step 25 (mid-epoch 1) resumes to the uninterrupted run's weights. One process: the scaler's state is per
    process, and a rank's resume is test_trainer.py's."""
    common = [*BASE, "train.precision=fp16", "data.batch_size=32", "train.grad_accum=2", "checkpoint.every_steps=5",
              "checkpoint.keep_last=20", "task.model.dropout=0.2", "train.max_steps=30"]  # fmt: skip
    run = tmp_path / "run"
    ref = final_digests(trainer(run, *common))
    scales = [torch.load(run / "checkpoints" / f"step_{s:08d}.pt", weights_only=True)["scaler"]["scale"]
              for s in (5, 25)]  # fmt: skip
    assert all(isinstance(s, float) and 0 < s <= 65536.0 for s in scales)
    truncate(run, 25)
    log = trainer(run, *common)
    assert re.search(r"resumed from step_00000025.pt \(step 25, epoch [1-9]", log), log
    assert final_digests(log) == ref
    fp32 = final_digests(trainer(tmp_path / "fp32", *[c for c in common if "precision" not in c]))
    assert fp32 != ref  # fp16 really ran


# --- best checkpoint, early stopping ----------------------------------------------------------------------------------


def test_the_best_checkpoint_survives_keep_last_pruning_and_resume(tmp_path):
    """max:eval/loss: the first evaluation (step 5) is the best, every later one worse. keep_last=1 keeps only the
    newest checkpoint plus that one; resumed from it, the restored best value keeps later evaluations from
    replacing it, and export --best writes its weights."""
    common = [*BASE, "train.eval_every=5", "checkpoint.every_steps=10", "checkpoint.keep_last=1",
              "checkpoint.monitor=max:eval/loss", "train.max_steps=30"]  # fmt: skip
    run = tmp_path / "run"
    ref = final_digests(trainer(run, *common))
    kept = sorted(p.name for p in (run / "checkpoints").glob("step_*.json"))
    assert kept == ["step_00000005.json", "step_00000030.json"]
    assert checkpoint.best_step(run / "checkpoints") == 5
    best_weights = checkpoint.load(checkpoint.find(run / "checkpoints", 5))["model"]  # type: ignore[arg-type]
    truncate(run, 5)  # the best one is all that is left: the run resumes from it
    log = trainer(run, *common)
    assert "resumed from step_00000005.pt" in log and final_digests(log) == ref
    assert checkpoint.best_step(run / "checkpoints") == 5
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*.json")) == kept
    info, state = export(RunDir(run), tmp_path / "best.pt", best=True)
    assert info.step == 5 and all(torch.equal(state[k], best_weights[k]) for k in best_weights)
    cli = subprocess.run([sys.executable, "-m", "jobs", "export", str(run), str(tmp_path / "cli.pt"), "--best"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert cli.returncode == 0 and "(step 5, full)" in cli.stdout, cli.stdout + cli.stderr
    refused = subprocess.run([sys.executable, "-m", "jobs", "export", str(run), str(tmp_path / "x.pt"), "--best",
                              "--step", "30"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode != 0 and "export takes --step or --best, not both" in refused.stderr


def test_early_stopping_ends_a_run_whose_metric_is_flat(tmp_path):
    run = tmp_path / "run"
    log = trainer(run, *BASE, "task.target=tests.support.metric_tasks:FlatMetricDigitsTask", "train.eval_every=5",
                  "checkpoint.monitor=min:eval/flat", "train.early_stop_patience=2", "train.max_steps=200",
                  nproc=2)  # fmt: skip
    assert "early stop at step 15" in log and "finished at step 15" in log
    done = events(run, "completed")
    assert done[-1]["early_stopped"] is True and done[-1]["step"] == 15 and done[-1]["final"]["flat"] == 1.0
    assert [r["step"] for r in records(run, "eval")] == [5, 10, 15]  # the deciding evaluation is the final one
    assert (run / "checkpoints" / "step_00000015.json").exists() and checkpoint.best_step(run / "checkpoints") == 5

    from jobs.runs.status import Row, render

    row = Row(RunDir(run), [], RunDir(run).events())
    assert row.early_stopped and "(early stop)" in render([row], "accuracy", None, 0.0)


# --- eval cap, streaming data, collate ------------------------------------------------------------------------------


def test_eval_batches_caps_the_evaluation(tmp_path):
    trainer(tmp_path / "all", *BASE, "train.max_steps=10", "data.eval_batch_size=32")
    trainer(tmp_path / "cap", *BASE, "train.max_steps=10", "data.eval_batch_size=32", "train.eval_batches=2")
    full, capped = records(tmp_path / "all", "eval")[-1], records(tmp_path / "cap", "eval")[-1]
    assert full["loss"] != capped["loss"]
    # The capped loss is the first 64 eval samples' mean: recompute it from the final checkpoint.
    from tests.support.tasks import DigitsTask

    task = DigitsTask()
    model = task.build_model()
    model.load_state_dict(checkpoint.load(checkpoint.find_latest(tmp_path / "cap" / "checkpoints"))["model"])  # type: ignore[arg-type]
    model.eval()
    _, evals = task.build_datasets()
    x, y = evals[:64]
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x), y).item()
    assert capped["loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(("workers", "nproc"), [(0, 1), (2, 2)])
def test_a_streaming_dataset_resumes_mid_epoch_exactly(tmp_path, workers, nproc):
    """An IterableDataset (dicts, batched by the task's collate_fn), read in the process and by 2 loader workers on
    2 ranks: the StatefulDataLoader's position is in the checkpoint, and a run cut mid-epoch (past the first epoch)
    resumes to the uninterrupted run's weights."""
    batch = 64 // nproc  # 1438 samples / 64 a step = 22 steps per epoch: step 25 is mid-epoch 1
    common = [*BASE, "task.target=tests.support.metric_tasks:StreamDigitsTask", f"data.batch_size={batch}",
              "checkpoint.every_steps=5", "checkpoint.keep_last=20", "task.model.dropout=0.2", "train.max_steps=30",
              f"data.num_workers={workers}"]  # fmt: skip
    run = tmp_path / "run"
    ref = final_digests(trainer(run, *common, nproc=nproc))
    assert len(set(ref)) == 1
    truncate(run, 25)
    log = trainer(run, *common, nproc=nproc)
    assert "resumed from step_00000025.pt (step 25, epoch 1)" in log, log
    assert final_digests(log) == ref
    if nproc == 1:
        return
    shuffled = final_digests(trainer(tmp_path / "map", *BASE, f"data.batch_size={batch}", "checkpoint.every_steps=5",
                                     "task.model.dropout=0.2", "train.max_steps=30", nproc=nproc))  # fmt: skip
    assert shuffled != ref  # the stream's order is its own, not the sampler's


# --- config and login-node checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.betas=[0.9]", "config key 'optim.betas' = [0.9] is invalid: must be two numbers in [0, 1)"),
        ("optim.eps=0", "config key 'optim.eps' = 0.0 is invalid: must be > 0"),
        ("optim.min_lr=1.0", "config key 'optim.min_lr' = 1.0 is invalid: must be in [0, optim.lr]"),
        ("checkpoint.monitor=median:eval/loss", "config key 'checkpoint.monitor' = 'median:eval/loss' has an unknown"),
        ("checkpoint.monitor=min:train/loss", "'checkpoint.monitor' = 'min:train/loss' is not a metric this can rank"),
        ("train.early_stop_patience=3", "'train.early_stop_patience' is set, but checkpoint.monitor is not"),
        ("train.eval_batches=-1", "config key 'train.eval_batches' = -1 is invalid: must be >= 0"),
    ],
)
def test_config_errors_are_one_line(override, message):
    with pytest.raises(DdpJobError) as err:
        load_config(DIGITS, ["run.name=x", override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fp16_is_refused_where_ranks_could_skip_steps_differently():
    with pytest.raises(DdpJobError, match=r"train.precision.*fsdp.*use bf16 there"):
        load_config(DIGITS, ["run.name=x", "train.precision=fp16", "strategy.name=fsdp"])
    with pytest.raises(DdpJobError, match=r"early_stop_patience.*eval_every = 0"):
        load_config(DIGITS, ["run.name=x", "checkpoint.monitor=min:eval/loss", "train.early_stop_patience=2",
                             "train.eval_every=0"])  # fmt: skip


def test_a_task_module_that_parses_argv_at_import_is_refused_before_it_runs(tmp_path, monkeypatch):
    (tmp_path / "argv_task.py").write_text(
        "import argparse\n"
        "from ddp_core.tasks.digits import DigitsTask\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--lr', type=float)\n"
        "args = parser.parse_args()\n"
        "class MyTask(DigitsTask):\n"
        "    pass\n"
    )
    (tmp_path / "guarded_task.py").write_text(
        "import argparse, sys\n"
        "from ddp_core.tasks.digits import DigitsTask\n"
        "class MyTask(DigitsTask):\n"
        "    pass\n"
        "def main():\n"
        "    argparse.ArgumentParser().parse_args(sys.argv[1:])\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["ddpjob", "submit", "--unknown-to-the-task"])
    with pytest.raises(DdpJobError) as err:
        check_task(TaskConfig(target="argv_task:MyTask"))
    assert f"{tmp_path / 'argv_task.py'}:5 calls parser.parse_args()" in str(err.value)
    assert "argv_task" not in sys.modules  # refused before its code ran
    check_task(TaskConfig(target="guarded_task:MyTask"))  # the __main__ guard: accepted


def test_a_submit_dry_run_names_the_module_level_argparse(tmp_path):
    (tmp_path / "argv_task2.py").write_text(
        "import argparse\nfrom ddp_core.tasks.digits import DigitsTask\nargparse.ArgumentParser().parse_args()\n"
        "class MyTask(DigitsTask):\n    pass\n"
    )
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "jobs", "submit", DIGITS, "--dry-run", "run.name=x",
                           "task.target=argv_task2:MyTask"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "argv_task2.py:3 calls argparse.ArgumentParser().parse_args()" in proc.stderr, proc.stderr
    assert "usage:" not in proc.stderr  # the task's argparse never ran
