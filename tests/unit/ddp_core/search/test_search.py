"""Adaptive sweeps without a cluster: the spec's validation, the ask-lock under concurrent workers, re-binding
orphaned trials, and the trainer's pruning through a real study on a journal file."""

from __future__ import annotations

import json
import multiprocessing
import time
from multiprocessing.synchronize import Barrier
from pathlib import Path

import optuna
import pytest

from ddp_core.config import TrialConfig
from ddp_core.errors import DdpJobError
from ddp_core.search.pruning import Reporter, bound_trial
from ddp_core.search.study import (
    JOURNAL_FILE,
    ask,
    create_study,
    distributions,
    open_storage,
    open_study,
    reassign,
    write_spec,  # fmt: skip
)
from jobs.sweeps.search_spec import load_search_file, parse_cli_search
from tests.support.helpers import ROOT, events, run_trainer

DIGITS = ROOT / "configs" / "digits.yaml"


def spec(budget: int, sampler: str = "random", pruner: str = "none") -> dict:
    return {"name": "s", "sampler": sampler, "pruner": pruner, "seed": 0, "direction": "minimize",
            "metric": "eval/loss", "budget": budget, "parallelism": 4, "generations": [],
            "params": {"optim.lr": {"dist": "loguniform", "low": 1e-4, "high": 1e-1},
                       "task.model.hidden": {"dist": "randint", "low": 16, "high": 65, "step": 16}}}  # fmt: skip


def new_study(folder: Path, s: dict) -> optuna.Study:
    write_spec(folder, s)
    return create_study(open_storage(str(folder / JOURNAL_FILE)), s)


@pytest.mark.parametrize(
    ("args", "flags", "message"),
    [
        (["optim.lrx=loguniform(1e-4,1e-1)"], {}, "search param 'optim.lrx' at 0.0001 is invalid: unknown config key"),
        (["optim.lr=uniform(-1,1)"], {}, "search param 'optim.lr' at -1 is invalid"),
        (["optim.lr=loguniform(0,1)"], {}, "'search.params.optim.lr' (loguniform) has low=0 <= 0"),
        (["slurm.nodes=choice(1,2)"], {}, "sweep key 'slurm.nodes' cannot be searched"),
        (["optim.lr=uniform(1e-3,1e-2)"], {"sampler": "bayes"}, "'search.sampler' = 'bayes' is unknown"),
        (["optim.lr=uniform(1e-3,1e-2)"], {"pruner": "early"}, "'search.pruner' = 'early' is unknown"),
        (["optim.lr=uniform(1e-3,1e-2)"], {"metric": "min:train/loss"}, "'search.metric' = 'min:train/loss' is not a"),
        (["optim.lr=uniform(1e-3,1e-2)"], {"sampler": "grid"}, "has no grid"),
        (["optim.lr=uniform(1e-3,1e-2)"], {"trials": 0}, "'search.trials' = 0 is invalid"),
        (["optim.lr=0.1"], {}, "'search.params' is empty"),
    ],
)
def test_bad_specs_fail_in_one_line_naming_the_key(args, flags, message):
    with pytest.raises(DdpJobError) as err:
        parse_cli_search(DIGITS, args, **flags)
    assert message in err.value.message
    assert "\n" not in str(err.value) and err.value.hint


def test_cli_and_file_specs(tmp_path):
    cli = parse_cli_search(DIGITS, ["optim.lr=loguniform(1e-4,1e-1)", "task.model.hidden=range(32,257,32)",
                                    "optim.name=adamw,sgd", "train.max_steps=50"], sampler="tpe", trials=8)  # fmt: skip
    assert cli.params["task.model.hidden"] == {"dist": "randint", "low": 32, "high": 257, "step": 32}
    assert cli.params["optim.name"] == {"dist": "choice", "values": ["adamw", "sgd"]}
    assert cli.fixed == {"train.max_steps": "50"} and cli.base_config.train.max_steps == 50
    assert (cli.metric, cli.direction, cli.trials) == ("eval/loss", "minimize", 8)
    dists = distributions(cli.params)
    assert dists["task.model.hidden"].high == 256 and dists["task.model.hidden"].step == 32  # high excluded
    assert dists["optim.lr"].log
    path = tmp_path / "s.yaml"
    path.write_text(f"base: {DIGITS}\nsearch:\n  sampler: random\n  metric: max:eval/accuracy\n  params:\n"
                    "    optim.lr: {dist: uniform, low: 0.001, high: 0.01, log: true}\n")  # fmt: skip
    file = load_search_file(path, ["train.max_steps=30"], trials=5)
    assert (file.direction, file.trials, file.params["optim.lr"]["log"]) == ("maximize", 5, True)
    path.write_text(f"base: {DIGITS}\nsearch:\n  params:\n    optim.lr: {{dist: uniform, low: 0, high: 1, log: 1}}\n")
    with pytest.raises(DdpJobError, match="log must be true or false"):
        load_search_file(path)


def _worker(folder: str, worker: str, out: multiprocessing.Queue, start: Barrier) -> None:
    _, study = open_study(Path(folder), seed_offset=hash(worker) % 1000)
    start.wait(120)  # all ask from the same moment: a worker spawned late under load would find no trial left
    got = []
    while (trial := ask(Path(folder), study, worker)) is not None:
        got.append(trial.number)
        time.sleep(0.05)  # a trial takes time: the others ask meanwhile
        study.tell(trial, 1.0)
    out.put(got)


def test_concurrent_workers_never_share_a_trial_nor_overshoot_the_budget(tmp_path):
    new_study(tmp_path, spec(24))
    ctx = multiprocessing.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(4)
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), f"1:{i}", out, start)) for i in range(4)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    numbers = sorted(n for g in got for n in g)
    assert numbers == list(range(24)), got  # each number once: no trial shared, none beyond the budget
    assert sum(1 for g in got if g) >= 2  # they did run concurrently
    _, study = open_study(tmp_path)
    trials = study.get_trials()
    assert len(trials) == 24 and {t.user_attrs["worker"] for t in trials} <= {f"1:{i}" for i in range(4)}


def test_orphans_are_rebound_round_robin_and_live_workers_keep_theirs():
    running = {3: "1:0", 4: "1:1", 7: "1:2", 9: "2:0"}
    alive = {"1:1"}
    moved = reassign(running, lambda w: w in alive, 3, 2)
    assert moved == {3: "3:0", 7: "3:1", 9: "3:0"}
    assert reassign(running, lambda w: True, 3, 2) == {}


def test_reporter_prunes_a_trial_worse_than_the_median(tmp_path):
    study = new_study(tmp_path, spec(8, pruner="median"))  # median pruner: 2 completed trials before it compares
    for value in (1.0, 1.2):
        trial = study.ask(distributions(spec(8)["params"]))
        trial.report(value, 10)
        study.tell(trial, value)
    trial = study.ask(distributions(spec(8)["params"]))
    reporter = Reporter(TrialConfig(storage=str(tmp_path / JOURNAL_FILE), number=trial.number, metric="loss"))
    assert not reporter.report(10, {"loss": 0.5, "accuracy": 0.9})
    other = study.ask(distributions(spec(8)["params"]))
    reporter = Reporter(TrialConfig(storage=str(tmp_path / JOURNAL_FILE), number=other.number, metric="loss"))
    assert reporter.report(10, {"loss": float("nan")})  # a diverged run is reported as inf: pruned
    stored = bound_trial(open_storage(str(tmp_path / JOURNAL_FILE)), study, other.number)
    assert study.get_trials()[other.number].intermediate_values == {10: float("inf")}
    assert stored.number == other.number
    with pytest.raises(DdpJobError, match="no 'los'"):
        Reporter(TrialConfig(storage=str(tmp_path / JOURNAL_FILE), number=other.number, metric="los")).report(
            20, {"loss": 1.0}
        )


def test_trainer_ends_a_pruned_trial_early_with_a_pruned_event(tmp_path):
    study = new_study(tmp_path, spec(8, pruner="median"))
    for value in (0.5, 0.6):
        done = study.ask(distributions(spec(8)["params"]))
        for step in (10, 20, 30):
            done.report(value, step)
        study.tell(done, value)
    trial = study.ask(distributions(spec(8)["params"]))
    run = tmp_path / "t0002"
    overrides = ["slurm.tasks_per_node=1", "train.max_steps=40", "train.eval_every=10", "optim.lr=5.0",
                 "train.stop_on_nan=false", f"trial.storage={tmp_path / JOURNAL_FILE}",
                 f"trial.number={trial.number}"]  # fmt: skip
    log = run_trainer(str(DIGITS), run, overrides)
    pruned = events(run, "pruned")
    assert len(pruned) == 1 and pruned[0]["step"] == 10 and not events(run, "completed"), log[-2000:]
    assert "pruned at step 10" in log
    frozen = study.get_trials()[trial.number]
    assert frozen.intermediate_values and max(frozen.intermediate_values) == 10
    assert json.loads((run / "attempts.jsonl").read_text().splitlines()[-1])["event"] == "pruned"
