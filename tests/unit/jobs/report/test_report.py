"""jobs/report: reports of runs, folders of runs, grid and adaptive sweeps, from fabricated run directories (no
Slurm, no torch): what each chart plots, the tables, --table, the PNG's panels, and the page in headless Chromium.
The report of a real sweep on the local cluster: tests/cluster/test_report_sweep.py."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs import cli
from jobs.report import PNG_SIZE, write_report, write_table
from jobs.runs import goodput
from jobs.runs.lookup import find_runs
from jobs.sweeps.record import infer_scale
from tests.support import browser
from tests.support.goodput import restarted_in_allocation, write_run
from tests.support.helpers import ROOT
from tests.support.report_pages import figures, png_panels

BASE = "/cfg/digits.yaml"


def make_run(path: Path, lr: float, accuracy: list[float] | None, eval_loss: float = 0.5, torn: bool = False) -> Path:
    """A run directory as the trainer leaves it: config.yaml, and metrics.jsonl unless ``accuracy`` is None."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"run": {"name": path.name}, "optim": {"lr": lr}}))
    if accuracy is None:
        return path  # submitted, not started: no metrics yet
    lines = []
    for step in range(25, 325, 25):
        lines.append({"step": step, "time": 1.7e9 + step, "split": "train", "loss": 2.0 * lr * 1000 / step, "lr": lr})
    for i, acc in enumerate(accuracy):
        lines.append({"step": 100 * (i + 1), "time": 1.7e9, "split": "eval", "accuracy": acc, "loss": eval_loss})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if torn:
        text += '{"step": 325, "time": 1.7e9, "split": "tr'  # the writer was killed mid-line
    (path / "metrics.jsonl").write_text(text)
    return path


def end(run: Path, *events: str) -> None:
    (run / "attempts.jsonl").write_text("".join(json.dumps({"event": e, "t": 1.0}) + "\n" for e in events))


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A folder of runs (no sweep.json): the swept key is the config key that differs."""
    root = tmp_path / "sweep"
    make_run(root / "lr-1e-3", 1e-3, [0.70, 0.85, 0.90], eval_loss=0.20)
    make_run(root / "lr-3e-3", 3e-3, [0.80, 0.93, 0.95], eval_loss=0.30, torn=True)
    make_run(root / "lr-1e-2", 1e-2, [0.60, 0.75, 0.80], eval_loss=0.60)
    make_run(root / "lr-3e-2", 3e-2, None)
    return root


LRS = (1e-4, 3e-4, 1e-3, 3e-3)
HIDDEN = (32, 64, 128)


@pytest.fixture
def grid(tmp_path: Path) -> Path:
    """A grid sweep as `ddpjob sweep` leaves it: 12 trials (lr x hidden), eval once at the end, sweep.json with
    each trial's overrides, loaded values and scales; one failed, one pruned, one running, one not started."""
    root = tmp_path / "grid"
    record: dict[str, Any] = {"name": "grid", "base_config": BASE, "trials": {}, "params": {}, "scales": {}}
    for i, (lr, hidden) in enumerate((lr, h) for lr in LRS for h in HIDDEN):
        tid = f"trial{i:02d}"
        run = root / tid
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump({"optim": {"lr": lr}, "task": {"model": {"hidden": hidden}}}))
        record["trials"][tid] = ["train.max_steps=30", f"optim.lr={lr!r}", f"task.model.hidden={hidden}"]
        record["params"][tid] = {"optim.lr": lr, "task.model.hidden": hidden}
        if i == 11:
            continue  # pending: no metrics, no events
        acc = 0.9 - 0.1 * abs(math.log10(lr) + 3) + hidden / 10_000  # best at lr=1e-3, hidden=128: trial08
        lines = [{"step": s, "time": 0, "split": "train", "loss": 1.0 / s} for s in (10, 20, 30)]
        if i != 4:  # trial04 failed before its evaluation
            lines.append({"step": 30, "time": 0, "split": "eval", "accuracy": acc, "loss": 1 - acc})
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        end(run, "start", {4: "failed", 5: "pruned", 6: "requeued"}.get(i, "completed"))
    record["scales"] = {"optim.lr": "log", "task.model.hidden": "linear"}
    (root / "sweep.json").write_text(json.dumps(record))
    return root


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def best_rows(page: str) -> list[str]:
    return re.findall(r'<tr class="best">(.*?)</tr>', page, re.S)


def test_find_runs_sweep_single_and_nested(sweep: Path, tmp_path: Path):
    names = [p.name for p in find_runs(sweep)]
    assert names == ["lr-1e-2", "lr-1e-3", "lr-3e-2", "lr-3e-3"]
    assert find_runs(sweep / "lr-1e-3") == [sweep / "lr-1e-3"]
    # <sweep>/<group>/<trial>/config.yaml; a config.yaml inside a run's own subfolders is not a run.
    nested = tmp_path / "nested"
    make_run(nested / "a" / "0", 1e-3, [0.5])
    make_run(nested / "b" / "0", 1e-3, [0.6])
    make_run(nested / "c", 1e-3, [0.7])
    (nested / "c" / "wandb").mkdir()
    (nested / "c" / "wandb" / "config.yaml").write_text("wandb_version: 1\n")
    assert [p.relative_to(nested).as_posix() for p in find_runs(nested)] == ["a/0", "b/0", "c"]
    assert find_runs(tmp_path / "missing") == []


def test_read_metrics_skips_torn_last_line(sweep: Path):
    records = RunDir(sweep / "lr-3e-3").metrics()
    assert len(records) == 12 + 3 and records[-1]["split"] == "eval"
    assert RunDir(sweep / "lr-3e-2").metrics() == []  # no metrics.jsonl yet
    garbled = sweep / "lr-1e-2" / "metrics.jsonl"
    garbled.write_text('{"step": 1, "split": "train", "loss": 1.0}\n\nnot json\n[1, 2]\n{"split": "train"}\n')
    assert RunDir(sweep / "lr-1e-2").metrics() == [{"step": 1, "split": "train", "loss": 1.0}]


def test_folder_of_runs_report(sweep: Path):
    png, page_path = write_report(sweep)
    assert (png, page_path) == (sweep / "report.png", sweep / "report.html")
    assert png_size(png) == PNG_SIZE == (1200, 800)
    page = page_path.read_text()

    # Self-contained: plotly.js inline in the head, and nothing outside it names a URL or fetches a file.
    head, _, rest = page.partition("</head>")
    plotly_js = head.split("<script>", 1)[1]
    assert plotly_js.startswith("/**\n* plotly.js v") and "<svg" not in rest  # no hand-written SVG any more
    assert not re.search(r"https?:|src=|<link|<iframe|@import", head.split("<script>", 1)[0] + rest)

    charts = figures(page)
    assert sorted(charts) == ["curve-eval/accuracy", "curve-eval/loss", "curve-train/loss", "slice"]
    [complete_or_running] = [t for t in charts["slice"]["data"] if t["name"] == "running"]  # no attempts.jsonl
    assert sorted(complete_or_running["x"]) == [1e-3, 3e-3, 1e-2]  # the run without metrics has no value
    assert charts["slice"]["layout"]["xaxis"]["type"] == "log"  # 1e-3 .. 3e-2, evenly in log space
    for key in ("curve-eval/accuracy", "curve-train/loss"):
        names = [t["name"] for t in charts[key]["data"]]
        assert sorted(names) == ["lr=0.001 (running)", "lr=0.01 (running)", "★ lr=0.003 (running)"]

    # The tables: every run, the empty one noted as pending, the best (max final eval/accuracy) marked once.
    assert [r for r in ("lr-1e-2", "lr-1e-3", "lr-3e-2", "lr-3e-3") if f"<td>{r}" not in page] == []
    assert "no metrics yet" in page and 'class="state-pending">pending<' in page
    [best, *_] = best_rows(page)
    assert "<td>lr-3e-3" in best and "★ best" in best and "0.95" in best
    assert "<th>optim.lr</th>" in page


def test_best_by_minimised_metric(sweep: Path, tmp_path: Path):
    _, page = write_report(sweep, tmp_path / "out", metric="min:eval/loss")
    assert "<td>lr-1e-3" in best_rows(page.read_text())[0]
    # Loss-like names are minimised without a prefix; max: forces maximisation.
    assert "<td>lr-1e-3" in best_rows(write_report(sweep, tmp_path / "out", metric="eval/loss")[1].read_text())[0]
    assert "<td>lr-1e-2" in best_rows(write_report(sweep, tmp_path / "out", metric="max:eval/loss")[1].read_text())[0]


def test_single_run_report_and_out_dir(sweep: Path, tmp_path: Path):
    run = sweep / "lr-1e-3"
    png, page_path = write_report(run, out_dir=tmp_path / "reports")
    assert png.parent == page_path.parent == tmp_path / "reports"
    assert [p["title"] for p in png_panels(png)] == ["train/loss", "eval/accuracy", "eval/loss"]
    page = page_path.read_text()
    charts = figures(page)
    assert sorted(charts) == ["curve-eval/accuracy", "curve-eval/loss", "curve-train/loss"]  # no slices of one run
    assert all([t["name"] for t in c["data"]] == ["★ lr-1e-3 (running)"] for c in charts.values())
    assert "<td>lr-1e-3" in best_rows(page)[0]
    assert not (sweep / "report.html").exists()


def test_single_run_report_says_its_goodput(sweep: Path, tmp_path: Path):
    run = write_run(tmp_path / "run", *restarted_in_allocation())
    page = write_report(run)[1].read_text()
    measured = goodput.of_run(RunDir(run))
    assert measured is not None and page.count("<h2>Goodput</h2>") == 1
    assert f'<p class="goodput">{measured.line()}</p>' in page
    cells = re.findall(r"<tr><td>steps trained again</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>", page)
    assert cells == [("5.6s", "13.3%", "14 steps")]
    assert "<h2>Goodput</h2>" not in write_report(sweep)[1].read_text()  # a folder of runs: each run has its own


def test_empty_run_still_reports(sweep: Path):
    png, page_path = write_report(sweep / "lr-3e-2")
    assert png_size(png) == PNG_SIZE
    page = page_path.read_text()
    assert "no metrics yet" in page and figures(page) == {} and best_rows(page) == []


def test_names_escaped_diverged_run_and_many_runs(tmp_path: Path):
    sweep = tmp_path / "big"
    make_run(sweep / "a<b>&c", 1e-3, [0.5, 0.6])
    diverged = make_run(sweep / "diverged", 2e-3, [0.4])
    with open(diverged / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 400, "time": 1.7e9, "split": "train", "loss": float("nan")}) + "\n")
    for i in range(12):  # 14 runs: past the PNG's legend limit
        make_run(sweep / f"trial-{i:02d}", 1e-3 * (i + 3), [0.1 * (i % 9)])
    png, page_path = write_report(sweep)
    assert png_size(png) == PNG_SIZE
    page = page_path.read_text()
    assert "<td>a&lt;b&gt;&amp;c" in page and "<td>a<b>" not in page
    train = figures(page)["curve-train/loss"]["data"]
    assert len(train) == 14 and sum(t["visible"] is True for t in train) == 10  # the best ten; the rest one click away
    assert "<td>nan</td>" in page  # the diverged run's final train loss is shown, not hidden


def test_grid_sweep_report_answers_the_sweep(grid: Path):
    png, page_path = write_report(grid)
    page = page_path.read_text()
    charts = figures(page)
    # Eval only at the end: one point per trial, so no eval curve; the metric against each key instead.
    assert sorted(charts) == ["curve-train/loss", "importance", "parallel", "slice"]

    layout, traces = charts["slice"]["layout"], charts["slice"]["data"]
    assert (layout["xaxis"]["type"], layout["xaxis2"]["type"]) == ("log", "linear")
    assert layout["xaxis"]["title"]["text"] == "optim.lr (log)"
    by_state = {t["name"]: t for t in traces if t["xaxis"] == "x"}
    assert len(by_state["complete"]["x"]) == 8 and by_state["pruned"]["x"] == [3e-4] and by_state["fail"]["x"] == []
    assert by_state["running"]["x"] == [1e-3]  # requeued, not ended: running, with its value so far
    [star] = [t for t in traces if t["name"].startswith("best") and t["xaxis"] == "x"]
    assert star["x"] == [1e-3] and star["name"] == "best: trial08"
    assert "1 trial(s) without a value" not in page and "2 trial(s) without a value" in page  # failed, pending

    # Parallel coordinates (Optuna's): every trial with a value, one dimension per key plus the metric.
    lines = [t for t in charts["parallel"]["data"] if t.get("mode") == "lines"]
    assert len(lines) == 10 and all(len(t["x"]) == 3 for t in lines)  # one line per trial: the metric, lr, hidden
    shares = dict(zip(charts["importance"]["data"][0]["y"], charts["importance"]["data"][0]["x"], strict=True))
    assert shares["optim.lr"] > 0.8 > 0.1 > shares["task.model.hidden"]  # the metric follows lr

    [curve] = [charts["curve-train/loss"]]
    best = [t for t in curve["data"] if t["name"].startswith("★")]
    assert [t["name"] for t in best] == ["★ lr=0.001 hidden=128"] and best[0]["line"]["width"] == 4
    assert {t["name"] for t in curve["data"]} >= {"lr=0.0003 hidden=64 (fail)", "lr=0.0003 hidden=128 (pruned)"}
    assert [b["label"] for b in curve["layout"]["updatemenus"][0]["buttons"]] == ["top 10", "all", "best only"]

    # The best trial's commands, and every trial in the table with its state.
    rerun = f"ddpjob submit {BASE} train.max_steps=30 optim.lr=0.001 task.model.hidden=128"
    assert f"rerun it as a single run: <code>{rerun}</code>" in page
    assert f"<code>ddpjob resume {grid / 'trial08'}</code>" in page
    assert "12 trials: 8 complete, 1 running, 1 pruned, 1 fail, 1 pending." in page
    for state in ("fail", "pruned", "running", "pending"):
        assert f'class="state-{state}">{state}<' in page
    assert page.count("<tr") == 1 + 10 + 1 + 12  # top 10 and all 12, each with its header row

    panels = png_panels(png)
    titles = ["eval/accuracy vs optim.lr", "eval/accuracy vs task.model.hidden", "train/loss"]
    assert [p["title"] for p in panels] == titles


def test_monitored_metric_ranks_by_each_trials_best_evaluation(tmp_path: Path):
    """With checkpoint.monitor set, a trial's value is its best evaluation (the checkpoint it keeps), not its last."""
    root = tmp_path / "monitored"
    for name, lr, accuracy in (("peaked", 1e-3, [0.9, 0.6]), ("steady", 1e-2, [0.7, 0.8])):
        run = make_run(root / name, lr, accuracy)
        config = yaml.safe_load((run / "config.yaml").read_text())
        (run / "config.yaml").write_text(yaml.safe_dump(config | {"checkpoint": {"monitor": "max:eval/accuracy"}}))
    page = write_report(root)[1].read_text()
    assert "best by eval/accuracy (max, best value per checkpoint.monitor): <b>peaked</b> = 0.9" in page
    rows = {r["trial"]: r for r in json.loads(write_table(root, "json", tmp_path).read_text())}
    assert rows["peaked"]["eval/accuracy (best)"] == 0.9 and rows["steady"]["final eval/accuracy"] == 0.8


def test_trial_table_csv_and_json(grid: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = write_table(grid, "csv", tmp_path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert path == tmp_path / "trials.csv" and len(rows) == 12  # every trial, the failed and pending ones too
    assert list(rows[0])[:6] == ["rank", "trial", "state", "optim.lr", "task.model.hidden", "eval/accuracy"]
    assert (rows[0]["trial"], rows[0]["state"], float(rows[0]["optim.lr"])) == ("trial08", "complete", 1e-3)
    assert rows[0]["run_dir"] == str(grid / "trial08")
    assert {r["trial"]: r["state"] for r in rows}["trial04"] == "fail" and rows[-1]["eval/accuracy"] == ""

    assert cli.main(["report", str(grid), "--table", "json", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"table: {tmp_path / 'trials.json'}"
    records = json.loads((tmp_path / "trials.json").read_text())
    assert [r["trial"] for r in records][:1] == ["trial08"] and len(records) == 12
    assert records[0]["final train/loss"] == pytest.approx(1 / 30) and records[-1]["eval/accuracy"] is None
    with pytest.raises(DdpJobError, match="not a table format"):
        write_table(grid, "xlsx")


def test_search_report_reads_the_study(tmp_path: Path):
    """An adaptive sweep: params and states come from its Optuna study, the history chart is Optuna's."""
    import optuna

    from ddp_core.search.study import RUN_DIR_ATTR, create_study, distributions, open_storage, write_spec

    root = tmp_path / "search"
    params = {"optim.lr": {"dist": "loguniform", "low": 1e-4, "high": 1e-1}, "optim.name": {"dist": "choice",
              "values": ["adamw", "sgd"]}}  # fmt: skip
    spec = {"name": "s", "sampler": "random", "pruner": "none", "seed": 0, "direction": "minimize",
            "metric": "eval/loss", "budget": 10, "parallelism": 2, "generations": [], "params": params,
            "base_config": BASE, "fixed": {"train.max_steps": "30"}}  # fmt: skip
    root.mkdir()
    write_spec(root, spec)
    study = create_study(open_storage(str(root / "study.journal")), spec)
    dists = distributions(params)
    for n in range(10):
        lr, name = 10 ** (-4 + 3 * n / 9), ["adamw", "sgd"][n % 2]
        run = make_run(root / f"t{n:04d}", lr, [0.5], eval_loss=abs(math.log10(lr) + 2.6))
        state = optuna.trial.TrialState.PRUNED if n == 9 else optuna.trial.TrialState.COMPLETE
        value = None if n == 9 else abs(math.log10(lr) + 2.6)
        trial = optuna.trial.create_trial(params={"optim.lr": lr, "optim.name": name}, distributions=dists,
                                          value=value, state=state, user_attrs={RUN_DIR_ATTR: str(run)})  # fmt: skip
        study.add_trial(trial)
    _, page_path = write_report(root)
    page = page_path.read_text()
    charts = figures(page)
    assert sorted(charts) == ["curve-train/loss", "history", "importance", "parallel", "slice"]
    assert (
        charts["slice"]["layout"]["xaxis"]["type"] == "log"
        and charts["slice"]["layout"]["xaxis2"]["type"] == "category"
    )
    assert "best by eval/loss (min, final value): <b>t0004</b>" in page  # the search's own metric and direction
    assert "ddpjob submit /cfg/digits.yaml train.max_steps=30 optim.lr=" in page and "optim.name=sgd" in page
    assert 'class="state-pruned">pruned<' in page and "search:  random on min:eval/loss" in page


def test_scales_recorded_at_sweep_time_and_inferred():
    from jobs.sweeps.spec import load_sweep_file, parse_cli_sweep

    cli_sweep = parse_cli_sweep(ROOT / "configs" / "digits.yaml", ["optim.lr=1e-4,3e-4,1e-3", "train.seed=range(0,3)"])
    assert cli_sweep.scales == {"optim.lr": "log", "train.seed": "linear"}
    random_sweep = load_sweep_file(ROOT / "configs" / "sweeps" / "digits-random.yaml", trials=3)
    assert random_sweep.scales == {"optim.lr": "log", "optim.weight_decay": "log", "task.model.dropout": "linear",
                                   "task.model.depth": "linear", "optim.name": "choice"}  # fmt: skip
    assert [infer_scale(v) for v in ([64, 128, 192], [1, 10, 100], [0.1, 0.2], ["a", "b"], [0, 1e-3, 1e-2])] == [
        "linear", "log", "linear", "choice", "linear"]  # fmt: skip


def test_errors_before_writing(tmp_path: Path, sweep: Path):
    with pytest.raises(DdpJobError, match="no run directories"):
        write_report(tmp_path / "nothing-here")
    with pytest.raises(DdpJobError, match=r"--metric = .* has an unknown prefix"):
        write_report(sweep, metric="median:eval/accuracy")
    assert not (sweep / "report.png").exists()


def test_import_is_light_and_cli(sweep: Path):
    # jobs.cli (what `ddpjob --help` imports) reads YAML for other commands; neither loads a plotting library.
    for module, heavy in (("jobs.report", ("yaml",)), ("jobs.cli", ())):
        heavy += ("matplotlib", "torch", "plotly", "optuna", "numpy", "sklearn")
        code = f"import sys, {module}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "[]", module
    cli_args = [sys.executable, "-m", "jobs.report", str(sweep), "--metric", "min:eval/loss"]
    out = subprocess.run(cli_args, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["png:", str(sweep / "report.png"), "html:", str(sweep / "report.html")]  # ddpjob's


def need_chromium() -> None:
    if browser.chromium() is None and os.environ.get("DDPJOB_REQUIRE_SLURM") != "1":  # scripts/test: required
        pytest.skip("chromium is not installed (scripts/slurm-local up installs it)")


def test_grid_page_renders_in_headless_chromium(grid: Path, tmp_path: Path):
    need_chromium()
    _, page = write_report(grid)
    rendered = browser.render(page, tmp_path / "browser")
    assert rendered.errors == []
    sections = browser.chart_sections(rendered.dom)
    assert sorted(sections) == ["curve-train/loss", "importance", "parallel", "slice"]
    assert [name for name, body in sections.items() if browser.drawn_marks(body) == 0] == []


def test_browser_catches_a_broken_page(tmp_path: Path):
    """The check the real sweep's page goes through (tests/cluster/test_report_sweep.py) sees errors and blank
    charts."""
    need_chromium()
    page = tmp_path / "broken.html"
    page.write_text('<html><head></head><body><section class="chart" data-chart="x"><div></div></section>'
                    "<script>undefinedFunction();</script></body></html>")  # fmt: skip
    rendered = browser.render(page, tmp_path / "browser", height=400)
    assert any("undefinedFunction" in e for e in rendered.errors)
    assert browser.drawn_marks(browser.chart_sections(rendered.dom)["x"]) == 0


def test_script_command_reads_a_trainer_config_without_parsing_it(tmp_path: Path):
    """status reads every trial's script command: a trainer run's config.yaml (to_yaml's layout) is not parsed."""
    from ddp_core.config import load_config, to_yaml

    trainer, script = RunDir(tmp_path / "trainer"), RunDir(tmp_path / "script")
    configs = ((trainer, ROOT / "configs" / "digits.yaml", []),
               (script, None, ["run.name=s", "script.path=train.py", "script.args=[--lr, '0.1']"]))  # fmt: skip
    for run, base, overrides in configs:
        run.path.mkdir()
        run.config_file.write_text(to_yaml(load_config(base, overrides)))
    assert trainer.script_command() is None
    assert script.script_command() == ["train.py", "--lr", "0.1"]
