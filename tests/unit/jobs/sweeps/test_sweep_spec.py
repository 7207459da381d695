"""Sweep specifications: expansion, reproducible random draws, validation of every trial, stable ids. No Slurm."""

import json
import time
from pathlib import Path

import pytest

from ddp_core.config import OptimizerName, load_config, trials
from ddp_core.errors import DdpJobError
from jobs.sweeps.spec import Sweep, is_sweep_file, load_sweep, load_sweep_file, parse_cli_sweep, split_values
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"
SWEEPS = ROOT / "configs" / "sweeps"

RANDOM_PARAMS = """
    optim.weight_decay: {dist: loguniform, low: 1.0e-5, high: 1.0e-1}
    task.model.dropout: {dist: uniform, low: 0.0, high: 0.3}
    task.model.depth: {dist: randint, low: 1, high: 4}
    optim.name: {dist: choice, values: [adamw, sgd]}
"""


def sweep_file(tmp_path: Path, body: str, base: str = str(DIGITS)) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {base}\n{body}")
    return path


def varying(sweep: Sweep) -> list[dict]:
    return [t.params for t in sweep.trials]


def test_cli_grid_is_the_cartesian_product_in_order():
    sweep = parse_cli_sweep(DIGITS, ["optim.lr=1e-4,3e-4,1e-3", "task.model.hidden=128,256"])
    assert len(sweep.trials) == 6
    assert [t.index for t in sweep.trials] == list(range(6))
    assert [t.overrides for t in sweep.trials[:3]] == [
        ("optim.lr=1e-4", "task.model.hidden=128"),
        ("optim.lr=1e-4", "task.model.hidden=256"),
        ("optim.lr=3e-4", "task.model.hidden=128"),
    ]
    assert varying(sweep)[-1] == {"optim.lr": 0.001, "task.model.hidden": 256}
    assert sweep.name == "digits-sweep"
    assert sweep.run_subdir(sweep.trials[0]) == Path("digits-sweep") / sweep.trials[0].trial_id


def test_range_expands_like_python_range():
    sweep = parse_cli_sweep(DIGITS, ["task.model.hidden=range(64,257,64)", "task.model.depth=range(1,3)"])
    assert [p["task.model.hidden"] for p in varying(sweep)[::2]] == [64, 128, 192, 256]
    assert [p["task.model.depth"] for p in varying(sweep)[:2]] == [1, 2]
    # range() mixes with plain values, and one value from range() is still a swept key
    assert varying(parse_cli_sweep(DIGITS, ["train.seed=range(3)", "data.batch_size=7,range(1,2)"]))[-1] == {
        "train.seed": 2,
        "data.batch_size": 1,
    }


def test_brackets_and_quotes_are_not_split():
    assert split_values("1,[a,b],{x: 1, y: 2},'c,d'") == ["1", "[a,b]", "{x: 1, y: 2}", "'c,d'"]
    sweep = parse_cli_sweep(DIGITS, ["wandb.tags=[a,b]", "optim.lr=1e-3,2e-3"])
    assert len(sweep.trials) == 2
    assert all(t.overrides[0] == "wandb.tags=[a,b]" for t in sweep.trials)
    assert load_config(DIGITS, sweep.trials[0].overrides).wandb.tags == ["a", "b"]
    sweep = parse_cli_sweep(DIGITS, ["wandb.tags=[a,b],[c]"])
    assert [p["wandb.tags"] for p in varying(sweep)] == [["a", "b"], ["c"]]


def test_fixed_overrides_go_into_every_trial():
    sweep = parse_cli_sweep(DIGITS, ["train.max_steps=50", "optim.lr=1e-3,2e-3", "optim.name=sgd"], name="lr")
    assert sweep.name == "lr"
    for trial in sweep.trials:
        assert trial.overrides[:2] == ("train.max_steps=50", "optim.name=sgd")
        assert set(trial.params) == {"optim.lr"}
        cfg = load_config(DIGITS, trial.overrides)
        assert (cfg.train.max_steps, cfg.optim.name) == (50, OptimizerName.sgd)


def test_shipped_sweep_files():
    grid = load_sweep(SWEEPS / "digits-grid.yaml")
    assert (grid.name, grid.base_config, len(grid.trials)) == ("digits-lr", DIGITS, 6)  # base: is relative to it
    assert all("train.max_steps=200" in t.overrides for t in grid.trials)
    rand = load_sweep(SWEEPS / "digits-random.yaml")
    assert (rand.name, len(rand.trials)) == ("digits-random", 8)
    assert is_sweep_file(SWEEPS / "digits-random.yaml") and not is_sweep_file(DIGITS)


def test_sweep_file_grid_times_random(tmp_path):
    path = sweep_file(
        tmp_path,
        "name: combo\noverrides: {train.max_steps: 200}\n"
        "grid:\n  optim.lr: [1.0e-4, 1e-3]\n  task.model.hidden: [64, 128]\n"
        f"random:\n  trials: 3\n  seed: 0\n  params:{RANDOM_PARAMS}",
    )
    sweep = load_sweep_file(path)
    assert len(sweep.trials) == 2 * 2 * 3
    assert sweep.trials[0].overrides[0] == "train.max_steps=200"
    draws = [{k: v for k, v in p.items() if k not in ("optim.lr", "task.model.hidden")} for p in varying(sweep)]
    assert draws[:3] == draws[3:6] == draws[9:12]  # every grid point gets the same random draws
    for p in varying(sweep):
        assert 1e-5 <= p["optim.weight_decay"] <= 1e-1 and 0.0 <= p["task.model.dropout"] <= 0.3
        assert p["task.model.depth"] in (1, 2, 3) and p["optim.name"] in ("adamw", "sgd")
    assert {p["task.model.depth"] for p in varying(load_sweep_file(path, trials=60))} == {1, 2, 3}  # high excluded
    # the command line wins over the file: --trials, --seed, and key=value extras replace the file's entries
    small = load_sweep_file(
        path, trials=1, extra=["optim.lr=5e-4", "task.model.depth=range(2,4)", "data.batch_size=16"]
    )
    assert len(small.trials) == 4
    assert all("optim.lr=5e-4" in t.overrides and "data.batch_size=16" in t.overrides for t in small.trials)
    assert [p["task.model.depth"] for p in varying(small)] == [2, 3, 2, 3]


def test_random_only_and_grid_only_files(tmp_path):
    rand = load_sweep_file(sweep_file(tmp_path, f"random:\n  trials: 5\n  params:{RANDOM_PARAMS}"))
    assert len(rand.trials) == 5 and rand.name == "sweep"
    grid = load_sweep_file(sweep_file(tmp_path, "grid:\n  optim.lr: range(1,3)\n  optim.name: [adamw, sgd]"))
    assert varying(grid)[1] == {"optim.lr": 1.0, "optim.name": "sgd"}


def test_random_is_reproducible_for_a_seed(tmp_path):
    path = sweep_file(tmp_path, f"random:\n  trials: 6\n  seed: 3\n  params:{RANDOM_PARAMS}")
    first, again = load_sweep_file(path), load_sweep_file(path)
    assert first == again and first.sweep_id == again.sweep_id
    other = load_sweep_file(path, seed=4)
    assert varying(other) != varying(first) and other.sweep_id != first.sweep_id
    # floats are written with repr: the override text loads back to exactly the drawn value
    for trial in first.trials:
        cfg = load_config(DIGITS, trial.overrides)
        assert cfg.optim.weight_decay == trial.params["optim.weight_decay"]
        assert cfg.task.model["dropout"] == trial.params["task.model.dropout"]


def test_trial_ids_are_canonical_and_stable():
    a = parse_cli_sweep(DIGITS, ["optim.lr=1e-3,2e-3"])
    b = parse_cli_sweep(DIGITS, ["optim.lr=0.001,0.002"])
    assert [t.trial_id for t in a.trials] == [t.trial_id for t in b.trials]
    assert a.trials[0].trial_id == "5dbb8b5de0"  # fixed: ids must not change between versions or machines
    assert len({t.trial_id for t in a.trials}) == 2 and len(a.trials[0].trial_id) == 10
    assert (
        parse_cli_sweep(DIGITS, ["optim.lr=1,2"]).trials[0].trial_id
        == parse_cli_sweep(DIGITS, ["optim.lr=1.0,2"]).trials[0].trial_id
    )  # the loaded value (float 1.0) decides, not the text
    assert parse_cli_sweep(DIGITS, ["optim.lr=1e-3,2e-3"], name="x").sweep_id != a.sweep_id  # name is in it


def test_same_config_twice_is_an_error():
    with pytest.raises(DdpJobError, match="trials 0 and 1 are the same config"):
        parse_cli_sweep(DIGITS, ["optim.lr=1e-3,0.001"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["optim.lr="], "sweep key 'optim.lr' has an empty value"),
        (["optim.lr=1e-3,"], "sweep key 'optim.lr' has an empty value"),
        (["optim.lrr=1,2"], "unknown config key 'optim.lrr'"),
        (["optim.lr=1e-3,abc"], "bad value for config key 'optim.lr'"),
        (["optim.lr=1e-3,-1"], "config key 'optim.lr' = -1.0 is invalid"),
        (["optim.name=adamw,adam"], "optim.name"),
        (["task.model.hidden=range(1,x)"], "sweep key 'task.model.hidden' has range(1,x)"),
        (["task.model.hidden=range(5,1)"], "sweep key 'task.model.hidden' has range(5,1)"),
        (["task.model.hidden=range(1,9,0)"], "sweep key 'task.model.hidden'"),
        (["task.model.hidden=range()"], "sweep key 'task.model.hidden'"),
        (["optim.lr"], "sweep argument 'optim.lr' is not key=value"),
        (["optim.lr=1,2", "optim.lr=3,4"], "sweep key 'optim.lr' is given twice"),
        (["task.model={hidden: 3},{hidden: 4}", "task.model.depth=1,2"], "sweep key 'task.model.depth' is given twice"),
        (["train.max_steps=100"], "nothing to sweep"),
        # valid alone, but optim.warmup_steps=20 (digits.yaml) must stay below train.max_steps: a cross-key check
        (["train.max_steps=100,10"], "sweep trial 1 (train.max_steps=10) is invalid: config key 'optim.warmup_steps'"),
    ],
)
def test_bad_cli_specs_name_the_key(args, needle):
    with pytest.raises(DdpJobError) as info:
        parse_cli_sweep(DIGITS, args)
    assert needle in str(info.value) and "hint:" in str(info.value)


def test_failing_trial_is_named_with_its_overrides():
    with pytest.raises(DdpJobError) as info:
        parse_cli_sweep(DIGITS, ["train.seed=1", "optim.lr=1e-3,2e-3", "data.batch_size=64,oops"])
    assert str(info.value).startswith("sweep trial 1 (train.seed=1 optim.lr=1e-3 data.batch_size=oops) is invalid:")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("grid:\n  optim.lr: []", "sweep key 'grid.optim.lr' must be a non-empty list"),
        ("grid:\n  optim.lr: 0.1", "sweep key 'grid.optim.lr' must be a non-empty list"),
        ("grid: {}", "sweep key 'grid' is empty"),
        ("grid:\n  optim.lrr: [1, 2]", "unknown config key 'optim.lrr'"),
        ("grid:\n  data.batch_size: [64, wide]", "'data.batch_size' = 'wide' is invalid: must be a number of samples"),
        ("grid:\n  optim.lr: [1, 2]\noverrides: {optim.lr: 3}", "sweep key 'optim.lr' is given twice"),
        ("grid:\n  optim.lr: [1, 2]\nsweeep: 1", "sweep key 'sweeep' is not a sweep file key"),
        ("grid:\n  optim.lr: [1, 2]\nname: a/b", "sweep key 'name'"),
        ("grid:\n  optim.lr: [1, 2]\noverrides: [a]", "sweep key 'overrides' must be a mapping"),
        ("random:\n  trials: 2", "sweep key 'random.params' is missing"),
        ("random:\n  params: {optim.lr: {dist: uniform, low: 0.1, high: 1}}", "sweep key 'random.trials' is missing"),
        ("random:\n  trials: 0\n  params: {optim.lr: {dist: uniform, low: 0.1, high: 1}}", "'random.trials' = 0"),
        ("random:\n  trials: 2\n  seed: x\n  params: {optim.lr: {dist: uniform, low: 0.1, high: 1}}", "random.seed"),
        ("random:\n  trials: 2\n  sed: 1\n  params: {a: 1}", "sweep key 'random.sed' is not a random: key"),
        (
            "random:\n  trials: 2\n  params: {optim.lr: {dist: normal, low: 0, high: 1}}",
            "unknown distribution 'normal'",
        ),
        ("random:\n  trials: 2\n  params: {optim.lr: 0.1}", "'random.params.optim.lr' has unknown distribution"),
        ("random:\n  trials: 2\n  params: {optim.lr: {dist: uniform, low: 1, high: 0.1}}", "low=1 > high=0.1"),
        ("random:\n  trials: 2\n  params: {optim.lr: {dist: loguniform, low: 0, high: 1}}", "low=0 <= 0"),
        ("random:\n  trials: 2\n  params: {optim.lr: {dist: uniform, low: 0.1}}", "uniform takes exactly low, high"),
        ("random:\n  trials: 2\n  params: {optim.name: {dist: choice, values: []}}", "non-empty values list"),
        ("random:\n  trials: 2\n  params: {task.model.depth: {dist: randint, low: 1, high: 4.5}}", "must be ints"),
        ("random:\n  trials: 2\n  params: {task.model.depth: {dist: randint, low: 2, high: 2}}", "low < high"),
        ("random:\n  trials: 2\n  params: {optim.lr: {dist: choice, values: [0.1, -1]}}", "'optim.lr' = -1.0"),
        ("random:\n  trials: 2\n  params: {data.batch_size: {dist: uniform, low: 1, high: 9}}", "data.batch_size"),
    ],
)
def test_bad_sweep_files_name_the_key(tmp_path, body, needle):
    with pytest.raises(DdpJobError) as info:
        load_sweep_file(sweep_file(tmp_path, body))
    assert needle in str(info.value) and "hint:" in str(info.value)


def test_base_config_problems(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("grid: {optim.lr: [1, 2]}")
    with pytest.raises(DdpJobError, match="sweep key 'base' is missing"):
        load_sweep_file(path)
    assert len(load_sweep_file(path, base=DIGITS).trials) == 2  # the command line may name it instead
    with pytest.raises(DdpJobError, match=r"config file .*nope\.yaml' not found"):
        load_sweep_file(sweep_file(tmp_path, "grid: {optim.lr: [1, 2]}", base="nope.yaml"))
    with pytest.raises(DdpJobError, match="--trials/--seed need"):
        load_sweep(DIGITS, ["optim.lr=1,2"], trials=3)


def test_fast_validation_matches_load_config(tmp_path):
    extra = ["wandb.tags=[a,b],[c]", "task.data={eval_fraction: 0.1},{split_seed: 3}", "train.precision=fp32,bf16"]
    path = sweep_file(tmp_path, f"overrides: {{train.max_steps: 90}}\nrandom:\n  trials: 4\n  params:{RANDOM_PARAMS}")
    sweep = load_sweep_file(path, extra=extra)
    fixed = ["train.max_steps=90"]
    combos = [dict(o.split("=", 1) for o in t.overrides[1:]) for t in sweep.trials]
    fast, failed = trials._fast_configs(DIGITS, fixed, combos, {})
    assert failed is None and len(fast) == len(sweep.trials) == 32
    assert fast == [load_config(DIGITS, t.overrides) for t in sweep.trials]


def test_fast_path_disagreement_falls_back_to_load_config(monkeypatch):
    expected = parse_cli_sweep(DIGITS, ["optim.lr=1e-3,2e-3,3e-3"])
    monkeypatch.setattr(trials, "_fast_configs", lambda *a: ([], 1))  # claims trial 1 is bad: it is not
    assert parse_cli_sweep(DIGITS, ["optim.lr=1e-3,2e-3,3e-3"]) == expected


def test_thousand_trials_are_fast(tmp_path):
    started = time.perf_counter()
    grid = parse_cli_sweep(
        DIGITS, ["optim.lr=range(1,11)", "task.model.hidden=range(8,108,10)", "train.seed=range(10)"]
    )
    grid_s = time.perf_counter() - started
    assert len(grid.trials) == 1000 and len({t.trial_id for t in grid.trials}) == 1000
    path = sweep_file(
        tmp_path, f"grid:\n  optim.lr: [1.0e-3, 3.0e-3]\nrandom:\n  trials: 500\n  params:{RANDOM_PARAMS}"
    )
    started = time.perf_counter()
    rand = load_sweep_file(path)
    rand_s = time.perf_counter() - started
    assert len(rand.trials) == 1000
    print(f"1,000 trials expanded + validated: grid {grid_s:.2f} s, grid x random {rand_s:.2f} s")


def test_a_sweep_run_again_with_another_base_config_is_refused(tmp_path):
    """A sweep's trial ids cover their own keys, not the base: run again under its name with a changed base, its old
    completed trials would count as done and the others resume with the new one. What the sweep recorded of its base
    (the config as read: comments and key order do not count) must match, or the sweep is refused in one line."""
    from jobs.sweeps.arrays import plan, sweep_dir
    from jobs.sweeps.record import SWEEP_FILE
    from tests.support.cli_runner import run_cli

    base = tmp_path / "base.yaml"
    text = (ROOT / "configs" / "digits.yaml").read_text()
    base.write_text(text)
    args = [f"run.root={tmp_path / 'runs'}", "optim.lr=1e-3,3e-3"]
    sweep = load_sweep(base, args)
    folder = sweep_dir(sweep)
    folder.mkdir(parents=True)
    (folder / SWEEP_FILE).write_text(json.dumps({"name": sweep.name, "base_digest": sweep.base_digest}))
    base.write_text("# the same config, said again\n" + text)
    assert len(plan(load_sweep(base, args))) == 2  # the same base as read
    base.write_text(text.replace("max_steps: 300", "max_steps: 301"))
    changed = run_cli("sweep", str(base), *args, "--dry-run", "--no-cluster-check", cwd=tmp_path)
    assert changed.returncode == 2, changed.stdout + changed.stderr
    assert f"sweep '{sweep.name}' in {folder} ran with another base config" in changed.stderr
