"""Throughput and efficiency in the progress lines (ddp_core/trainer/telemetry.py), the peak FLOP/s table, the
tasks' FLOPs estimates, profile windows (ddp_core/trainer/profiling.py) and what a machine without a GPU or NVML
gets: the figures a run records are checked by hand against its own samples/s."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_core.tasks.charlm import CharLMTask
from ddp_core.tasks.flops import dense_params, transformer_flops_per_sample
from ddp_core.trainer import telemetry
from ddp_core.trainer.peak_flops import from_table
from tests.support.digits import trainer
from tests.support.helpers import ROOT
from tests.support.metric_tasks import KnownFlopsDigitsTask

BASE = ["train.eval_every=0", "checkpoint.every_steps=0", "wandb.mode=disabled", "train.log_every=10",
        "optim.warmup_steps=5"]  # fmt: skip
PERF_KEYS = {"samples_per_s", "step_ms_p50", "step_ms_p95", "data_wait", "peak_rss_gb"}


def train_records(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_mfu_tokens_and_a_profile_window_at_two_ranks(tmp_path):
    """2 ranks (torchrun), a task of 1e6 FLOPs and 8 tokens per sample, a "peak" of 0.5 TFLOP/s per rank: each
    line's MFU and tokens/s are its samples/s times those figures, over both ranks' peak. The profile window (steps
    11-13) writes one trace per rank, marking exactly those steps; no other trace exists. GPU telemetry asked for on
    this CPU machine: a warning on each rank, and the run completes."""
    run = tmp_path / "run"
    log = trainer(run, *BASE, "task.target=tests.support.metric_tasks:KnownFlopsDigitsTask", "train.max_steps=40",
                  "train.peak_tflops=0.5", "train.profile.start_step=10", "train.profile.steps=3",
                  "train.gpu_telemetry=true", nproc=2)  # fmt: skip
    assert "against 0.5 TFLOP/s per device x 2 (train.peak_tflops)" in log
    assert log.count("train.gpu_telemetry=true, but this rank has no GPU") == 2
    records = train_records(run)
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    global_batch = 2 * 32  # data.batch_size 32 per rank in digits.yaml
    for r in records:
        assert r["samples_per_s"] == pytest.approx(1000 * global_batch / r["step_ms"], rel=1e-9)
        by_hand = r["samples_per_s"] * KnownFlopsDigitsTask.FLOPS / (0.5e12 * 2)
        assert r["mfu"] == pytest.approx(by_hand, rel=1e-9)
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * KnownFlopsDigitsTask.TOKENS, rel=1e-9)
        assert 0 < r["step_ms_p50"] <= r["step_ms_p95"] and 0 <= r["data_wait"] < 1 and r["peak_rss_gb"] > 0.05
        assert not {"gpu_util", "power_w", "energy_j"} & set(r)  # no GPU: no readings, not zeros
    assert "mfu " in log and "tokens/s " in log and "data_wait " in log  # the progress line shows them
    traces = sorted(p.relative_to(run / "profiles").as_posix() for p in (run / "profiles").rglob("*") if p.is_file())
    assert traces == ["steps_11-13/rank0.pt.trace.json", "steps_11-13/rank1.pt.trace.json"]
    for name in traces:
        events = json.loads((run / "profiles" / name).read_text())["traceEvents"]
        steps = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#11", "ProfilerStep#12", "ProfilerStep#13"}


def test_no_mfu_without_a_peak_and_no_figures_with_telemetry_off(tmp_path):
    """On a CPU without train.peak_tflops there is no MFU (the log says why), the rest is there; with
    train.telemetry=false the lines hold none of it."""
    log = trainer(tmp_path / "on", *BASE, "train.max_steps=20")
    assert "no MFU: no peak FLOP/s for a cpu device (set train.peak_tflops)" in log
    for r in train_records(tmp_path / "on"):
        assert PERF_KEYS <= set(r) and "mfu" not in r and "tokens_per_s" not in r  # digits: FLOPs, no tokens
    trainer(tmp_path / "off", *BASE, "train.max_steps=20", "train.telemetry=false")
    for r in train_records(tmp_path / "off"):
        assert not (PERF_KEYS - {"samples_per_s"}) & set(r) and "mfu" not in r


def test_percentiles_and_mfu_by_hand():
    values = sorted([5.0, 1.0, 3.0, 2.0, 4.0, 10.0])
    assert telemetry.percentile(values, 50) == statistics.median(values)
    assert telemetry.percentile(values, 95) == pytest.approx(5.0 + 0.75 * 5.0)  # numpy's linear: index 4.75
    assert telemetry.percentile([7.0], 95) == 7.0 and math.isnan(telemetry.percentile([], 50))
    assert telemetry.mfu(1000, 6e9, 989, 8) == pytest.approx(1000 * 6e9 / (989e12 * 8))


def test_peak_table_by_device_name_and_dtype():
    assert from_table("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert from_table("NVIDIA H100 PCIe", "bf16") == 756.0
    assert from_table("NVIDIA H200", "tf32") == 494.0
    assert from_table("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert from_table("NVIDIA L40S", "bf16") == 362.0 and from_table("NVIDIA L4", "bf16") == 121.0
    assert from_table("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on Volta: no figure, no MFU
    assert from_table("Some Future GPU", "bf16") is None


def test_transformer_flops_estimate_by_hand():
    task = CharLMTask(seq_len=16)
    model = task.build_model(d_model=32, n_layers=2, n_heads=4)
    per_block = 3 * (32 * 32 + 32) + (32 * 32 + 32) + 2 * (2 * 32) + (32 * 128 + 128) + (128 * 32 + 32)
    dense = 2 * per_block + 2 * 32 + (32 * 256 + 256)  # the blocks, the head's norm and projection
    assert dense_params(model) == dense  # the byte and position embeddings are lookups
    assert task.flops_per_sample(model) == 16 * (6 * dense + 12 * 2 * 32 * 16)
    assert transformer_flops_per_sample(dense, 2, 32, 16) == task.flops_per_sample(model)
    assert task.tokens_per_sample() == 16
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert dense_params(tied) == 0  # a table shared with a head counts once, as the embedding's


def test_gpu_telemetry_on_a_cpu_rank_and_the_flight_recorder_without_nccl(tmp_path, caplog, monkeypatch):
    from ddp_core.distributed import flight_recorder
    from ddp_core.trainer.gpu_meter import GpuMeter

    with caplog.at_level("WARNING"):
        assert not GpuMeter(None, torch.device("cpu")).active and not caplog.records  # null: silent
        meter = GpuMeter(True, torch.device("cpu"))
    assert not meter.active and "has no GPU" in caplog.text
    assert all(math.isnan(v) for v in meter.sample())
    monkeypatch.delenv(flight_recorder.BUFFER_ENV, raising=False)
    flight_recorder.enable(False)
    assert flight_recorder.BUFFER_ENV not in __import__("os").environ  # gloo: no NCCL buffer to size
    assert flight_recorder.dump(tmp_path, 0) is None and not list(tmp_path.iterdir())


def test_submit_warns_once_without_nvml(tmp_path):
    """train.gpu_telemetry=true where nvidia-ml-py cannot be imported (a stand-in module that refuses, first on the
    path): one warning line, the config still loads and checks."""
    (tmp_path / "pynvml.py").write_text("raise ImportError('not installed here')\n")
    code = (
        "from ddp_core.config import load_config\nfrom jobs.submission.checks import check_code\n"
        f"cfg = load_config({str(ROOT / 'configs' / 'digits.yaml')!r}, ['train.gpu_telemetry=true'])\n"
        "check_code(cfg); check_code(cfg)\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("train.gpu_telemetry=true, but nvidia-ml-py is not installed here") == 1, proc.stderr


def test_a_request_file_turns_profiling_on_and_off_at_log_steps(tmp_path):
    """RUN/profile-now: the window starts at the next multiple of train.log_every, runs for the steps the file says
    or until the file goes (checked at those steps), and the same file is not served twice."""
    from ddp_core.config import load_config
    from ddp_core.trainer.profiling import Profiler

    cfg = load_config(None, ["run.name=p", "train.log_every=5", "train.profile.steps=0"])
    profiler = Profiler(cfg, tmp_path, 0, torch.device("cpu"))
    request = tmp_path / "profile-now"

    def run(steps: range) -> None:
        for step in steps:
            torch.ones(4).sum()  # something to record
            profiler.after_step(step)

    request.write_text("3\n")
    run(range(1, 16))  # seen at step 5: steps 6-8
    run(range(16, 31))  # the same file: not served again
    request.write_text("")  # rewritten: asked again, with no count: until removed (10 steps at most here)
    run(range(31, 38))  # seen at step 35
    request.unlink()
    run(range(38, 46))  # gone at step 40: steps 36-40
    windows = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert windows == ["steps_36-40", "steps_6-8"]
    assert all((tmp_path / "profiles" / w / "rank0.pt.trace.json").is_file() for w in windows)
