"""What scripts/gpu-check runs: the ddpjob trainer on this machine's NVIDIA GPUs, every strategy, against a
hand-written DDP loop, plus a deterministic exact-resume check; one table at the end.

On a machine with G CUDA GPUs, on the char LM (configs/charlm.yaml) at a GPU size, all in bf16 autocast, W&B
disabled. Default d_model 1024, 8 layers, 16 heads, seq 512: ~101.7M params; 6 x params x tokens per step is
~7.5 TFLOP per GPU at batch 24, ~50 ms at the ~150 TFLOP/s of effective bf16 first assumed; an H100 80GB (torch
2.11+cu130) measured 28.7 ms there (~260 TFLOP/s), so the default batch is 40 per GPU (~12.5 TFLOP; 43.5 ms/step
measured for the hand-written loop, ~9 GB peak):
  ddp (G ranks), dp (1 process, G GPUs), model_parallel (1 process, split over G GPUs), fsdp with bf16
  mixed precision (G ranks), pipeline (2 stages if G >= 2, else 1; G ranks), each one short run with one
  checkpoint inside it and one small eval at the end; then bench/ddp_baseline.py (G ranks, the PyTorch
  tutorial's DDP loop) on the same model and per-GPU batch; then ddp with train.deterministic=true run
  uninterrupted (A) and interrupted by SIGUSR2 halfway and resumed from its run directory (B): the final
  weights digests must be equal.
Every strategy gets the same global batch (batch per GPU x GPUs), so ms/step compares throughput directly.
Ranks are started here as plain processes with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): even a one-rank run joins a process group (NCCL, and gloo).

Without a CUDA GPU it prints one line and runs nothing (exit 0). DDPJOB_GPU_CHECK_CPU=1 rehearses the same
flow on the CPU with gloo and a tiny model (2 ranks where the GPU check would use G).

    scripts/gpu-check [--out DIR] [--d-model N] [--layers N] [--seq-len N] [--batch-size N] [--steps N]

Timings come from the run's metrics.jsonl ``train`` lines (step, epoch time): the steady-state window skips
the first two log intervals and every interval that holds a checkpoint or an eval.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
CHARLM = ROOT / "configs" / "charlm.yaml"
BASELINE = ROOT / "bench" / "ddp_baseline.py"
# The hand-written loops, by the strategy each is the reference of: ddp's (every strategy's ratio is against it) and
# fsdp's (FSDP2 as its tutorial writes it: ddpjob's fsdp against it, target FSDP_TARGET).
BASELINES = {"ddp": ("hand-written DDP", BASELINE), "fsdp": ("hand-written FSDP2", ROOT / "bench" / "fsdp_baseline.py")}
FSDP_TARGET = 1.10
WHEELS = ROOT / ".whl"
CPU_ENV = "DDPJOB_GPU_CHECK_CPU"
STRATEGIES = ("ddp", "dp", "model_parallel", "fsdp", "pipeline")
LR, WEIGHT_DECAY = 1e-3, 0.01
DIGEST = re.compile(r"final weights sha256 ([0-9a-f]{64})")
# Checkpoint save time from the rank-0 log when metrics.jsonl has no "checkpoint" line: "saved checkpoint step N in
# S s", else the checkpoint writers' own lines ("checkpoint step 20 saved (410.3 MB, 0.85 s): ..." and the sharded
# "(2 files, 410.3 MB, 0.85 s, training blocked 0.80 s)").
SAVED = re.compile(r"saved checkpoint step (\d+) in ([\d.]+) s")
SAVED_NOW = re.compile(r"checkpoint step (\d+) saved \((?:[^()]*?, )?([\d.]+) s(?:, training blocked ([\d.]+) s)?\)")
STOPPED = re.compile(r"stopping at step (\d+)")
STOPPED_EXIT = 4  # ddp_core.cluster.exits.ExitCode.STOPPED: a run stopped by a signal outside Slurm
SIGNAL_AT = "DDPJOB_GPU_CHECK_SIGNAL_AT"  # read by bench/signalled_task.py, the resume check's task


@dataclass
class Sizes:
    d_model: int
    layers: int
    heads: int
    seq_len: int
    batch_size: int  # per GPU (per rank in the rehearsal)
    steps: int
    log_every: int
    resume_steps: int
    max_chars: int = 0  # filled from the corpus
    eval_fraction: float = 0.0

    @property
    def window_start(self) -> int:
        """The first step of the timed window: two log intervals of warm-up (allocator, autotuning, NCCL)."""
        return min(2 * self.log_every, self.steps - self.log_every)

    @property
    def checkpoint_step(self) -> int:
        """One checkpoint inside each run, on a log boundary, so its interval can be left out of the timing."""
        return max(self.log_every, self.steps // 2 // self.log_every * self.log_every)


GPU_SIZES = dict(d_model=1024, layers=8, heads=16, seq_len=512, batch_size=40, steps=40, log_every=5, resume_steps=40)
CPU_SIZES = dict(d_model=32, layers=2, heads=2, seq_len=32, batch_size=8, steps=12, log_every=2, resume_steps=16)


@dataclass
class Row:
    strategy: str
    procs: int
    gpus: str  # "2 GPUs", or "CPU" in the rehearsal
    global_batch: int
    status: str = "ok"  # ok | FAILED
    error: str = ""
    ms_per_step: Optional[float] = None
    samples_per_s: Optional[float] = None
    ratio: Optional[float] = None
    peak_mem_gb: Optional[float] = None
    checkpoint_save_s: Optional[float] = None
    window_steps: int = 0
    run_dir: str = ""
    wall_s: float = 0.0
    overrides: list[str] = field(default_factory=list)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check", description="ddpjob on this machine's GPUs: strategies vs hand-written DDP, resume"
    )
    parser.add_argument("--d-model", type=int, help="model width (GPU default 1024)")
    parser.add_argument("--layers", type=int, help="transformer blocks (default 8)")
    parser.add_argument("--heads", type=int, help="attention heads (default 16: head dim 64)")
    parser.add_argument("--seq-len", type=int, help="bytes per sequence (default 512)")
    parser.add_argument("--batch-size", type=int, help="sequences per GPU and step (default 40)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 40)")
    parser.add_argument("--log-every", type=int, help="train.log_every (default 5)")
    parser.add_argument("--resume-steps", type=int, help="steps of the exact-resume runs (default 40)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset to run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the hand-written DDP loop")
    parser.add_argument("--no-resume", action="store_true", help="skip the exact-resume check")
    parser.add_argument("--out", type=Path, help="also write the table (results.md) and raw numbers (results.json)")
    parser.add_argument("--work-dir", type=Path, help="run directories and rank logs (default runs/gpu-check-<time>)")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints (GBs)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch before its ranks are killed")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.strategies.split(",")) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    return args


def sizes_from(args: argparse.Namespace, rehearsal: bool) -> Sizes:
    base = CPU_SIZES if rehearsal else GPU_SIZES
    chosen = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    sizes = Sizes(**chosen)
    if sizes.d_model % sizes.heads:
        raise SystemExit(f"gpu-check: --heads {sizes.heads} does not divide --d-model {sizes.d_model}")
    if sizes.steps < 3 * sizes.log_every or sizes.resume_steps < 4:
        raise SystemExit(f"gpu-check: --steps must be >= 3 x --log-every ({3 * sizes.log_every}), --resume-steps >= 4")
    return sizes


# ---------------------------------------------------------------- environment


def ensure_omegaconf() -> list[str]:
    """The trainer's one dependency a bare GPU box may lack: install .whl/'s wheels (omegaconf, pure Python) into
    .whl/site without the network and return the extra PYTHONPATH entries the ranks need."""
    try:
        import omegaconf  # noqa: F401

        return []
    except ImportError:
        pass
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit(
            "gpu-check: omegaconf is not installed and .whl/ holds no wheels; "
            f"`{sys.executable} -m pip install omegaconf` or copy its wheel into {WHEELS}"
        )
    site = WHEELS / "site"
    if not (site / "omegaconf").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        proc = subprocess.run([*cmd, "--target", str(site), *map(str, wheels)], capture_output=True, text=True)
        if proc.returncode != 0:  # no pip: pure-Python wheels import from the zip files themselves
            print(f"gpu-check: pip could not unpack .whl/ ({proc.stderr.strip()[-200:]}); importing the wheels as zips")
            paths = [str(w) for w in wheels]
            sys.path[:0] = paths
            return paths
    sys.path.insert(0, str(site))
    return [str(site)]


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """Starts the ranks of one job as plain processes with torchrun's variables, and waits for them (fail fast)."""

    def __init__(self, rehearsal: bool, gpus: int, extra_paths: list[str], timeout: float) -> None:
        self.rehearsal, self.gpus, self.timeout = rehearsal, gpus, timeout
        drop = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_")
        launcher_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                         "MASTER_PORT"}  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in launcher_vars}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *extra_paths, *filter(None, [env.get("PYTHONPATH")])])
        env.update(WANDB_MODE="disabled", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
        if rehearsal:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the rehearsal stays on the CPU even where a GPU exists
        self.env = env
        self.live: list[subprocess.Popen] = []  # every rank started and not yet reaped: killed if we are interrupted

    def threads(self, nproc: int) -> int:
        cores = os.cpu_count() or 1
        if self.rehearsal:  # oversubscribed CPU ranks ran 3x slower (torch-cpu.md)
            return max(1, cores // nproc)
        return max(1, min(8, cores // max(nproc, self.gpus)))  # GPU ranks need a few threads, not all cores

    def start(self, argv: list[str], nproc: int, log_dir: Path, tag: str = "", extra_env: Optional[dict] = None):
        port = free_port()
        procs = []
        for rank in range(nproc):
            env = self.env | (extra_env or {})
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                       GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS=str(self.threads(nproc)))  # fmt: skip
            log_path = log_dir / f"rank{rank}{tag}.log"
            with open(log_path, "w") as log:
                proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            procs.append(proc)
        self.live += procs
        return procs

    def wait(
        self, procs: list[subprocess.Popen], grace_s: float = 10.0, ok: tuple[int, ...] = (0,)
    ) -> tuple[Optional[int], str]:
        """Wait for every rank. Returns (None, "") on success, else (failing rank, reason); once one rank fails
        the others get ``grace_s`` to fail or finish and are then killed (an NCCL peer would otherwise wait for
        the process group's timeout)."""
        deadline = time.monotonic() + self.timeout
        failed: Optional[int] = None
        reason = ""
        while any(p.poll() is None for p in procs):
            if failed is None:
                for rank, p in enumerate(procs):
                    if p.returncode is not None and p.returncode not in ok:
                        failed, reason = rank, f"rank {rank} exited with {p.returncode}"
                        deadline = min(deadline, time.monotonic() + grace_s)
                        break
            if time.monotonic() > deadline:
                if failed is None:
                    failed, reason = 0, f"timed out after {self.timeout:.0f} s"
                kill(procs)
                break
            time.sleep(0.05)
        self.live = [p for p in self.live if p not in procs]
        if failed is None:
            for rank, p in enumerate(procs):
                if p.returncode not in ok:
                    return rank, f"rank {rank} exited with {p.returncode}"
        return failed, reason


def kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the rank and anything it started
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(f"    {line}" for line in text[-lines:])


# ---------------------------------------------------------------- configs and measurements


def trainer_overrides(name: str, sizes: Sizes, batch: int, steps: int, log_every: int, ckpt_every: int) -> list[str]:
    return [
        f"run.name=gpu-check-{name}",
        "wandb.mode=disabled",
        "task.target=ddp_core.tasks.charlm:CharLMTask",
        f"task.model.d_model={sizes.d_model}",
        f"task.model.n_layers={sizes.layers}",
        f"task.model.n_heads={sizes.heads}",
        "task.model.dropout=0.0",
        f"task.data.seq_len={sizes.seq_len}",
        f"task.data.max_chars={sizes.max_chars}",
        f"task.data.eval_fraction={sizes.eval_fraction}",
        f"data.batch_size={batch}",
        f"data.eval_batch_size={sizes.batch_size}",
        f"optim.lr={LR}",
        f"optim.weight_decay={WEIGHT_DECAY}",
        "optim.warmup_steps=0",
        f"train.max_steps={steps}",
        "train.eval_every=0",  # one eval, at the end
        f"train.log_every={log_every}",
        "train.precision=bf16",
        f"checkpoint.every_steps={ckpt_every}",
        "checkpoint.keep_last=1",
    ]


def size_corpus(sizes: Sizes, gpus: int) -> None:
    """Enough text that no run wraps into a second epoch, and an eval set of ~2 batches per GPU."""
    from ddp_core.tasks.charlm import stdlib_text

    train_windows = max(sizes.steps, sizes.resume_steps) * sizes.batch_size * gpus
    eval_windows = 2 * sizes.batch_size * gpus
    wanted = (math.ceil(train_windows * 1.02) + eval_windows + 2) * sizes.seq_len
    available = len(stdlib_text(wanted))  # the stdlib may hold less: then the runs just start another epoch
    sizes.max_chars = max(wanted, 100_000)
    sizes.eval_fraction = round(min(0.5, (eval_windows + 1) * sizes.seq_len / max(1, available)), 6)


def strategy_plan(name: str, sizes: Sizes, gpus: int, rehearsal: bool) -> tuple[int, int, str, list[str]]:
    """(processes, batch per data-parallel replica, 'ranks/GPUs' label, strategy overrides); the global batch is
    batch_size x gpus for every strategy."""
    where = "CPU" if rehearsal else plural(gpus, "GPU")
    b = sizes.batch_size
    if name in ("ddp", "fsdp"):
        extra = ["strategy.name=fsdp", "strategy.mixed_precision=bf16"] if name == "fsdp" else ["strategy.name=ddp"]
        return gpus, b, f"{plural(gpus, 'rank')} / {where}", [*extra, f"slurm.tasks_per_node={gpus}"]
    if name in ("dp", "model_parallel"):
        return 1, b * gpus, f"1 process / {where}", [f"strategy.name={name}"]
    stages = 2 if gpus >= 2 else 1
    world = gpus - gpus % stages  # an odd GPU count leaves one GPU out
    replicas = world // stages
    batch = b * world // replicas
    microbatches = next(m for m in (4, 2, 1) if batch % m == 0)
    label = f"{plural(world, 'rank')}, {plural(stages, 'stage')} / {where}"
    overrides = ["strategy.name=pipeline", f"strategy.stages={stages}", f"strategy.microbatches={microbatches}",
                 "strategy.schedule=1f1b", f"slurm.tasks_per_node={world}"]  # fmt: skip
    return world, batch, label, overrides


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    from ddp_core.run.rundir import RunDir  # after main() has put the repository on sys.path

    return RunDir(run_dir).metrics()


def steady_window(points: list[tuple[int, float]], start: int, busy: set[int]) -> tuple[int, float]:
    """(steps, seconds) over consecutive logged intervals (a, b] with a >= start that hold no checkpoint or eval:
    one taken after step c (logged first) delays the interval (c, next]."""
    steps, seconds = 0, 0.0
    for (a, ta), (b, tb) in itertools.pairwise(points):
        if a < start or any(a <= c < b for c in busy):
            continue
        steps, seconds = steps + b - a, seconds + tb - ta
    return steps, seconds


def measure(row: Row, run_dir: Path, sizes: Sizes, ckpt_step: int) -> None:
    metrics = read_metrics(run_dir)
    train = sorted((r for r in metrics if r.get("split") == "train"), key=lambda r: r["step"])
    busy = {ckpt_step} | {r["step"] for r in metrics if r.get("split") in ("eval", "checkpoint")}
    steps, seconds = steady_window([(r["step"], r["time"]) for r in train], sizes.window_start, busy)
    if steps and seconds > 0:
        row.window_steps = steps
        row.ms_per_step = 1000 * seconds / steps
        row.samples_per_s = row.global_batch * steps / seconds
    peaks = [r["peak_mem_gb"] for r in train if isinstance(r.get("peak_mem_gb"), (int, float))]
    row.peak_mem_gb = max(peaks) if peaks else None
    saves = [r["save_s"] for r in metrics if r.get("split") == "checkpoint" and "save_s" in r]
    if not saves:
        log = (run_dir / "rank0.log").read_text(errors="replace") if (run_dir / "rank0.log").exists() else ""
        saves = [float(s) for step, s in SAVED.findall(log) if int(step) == ckpt_step]
        if not saves:
            found = SAVED_NOW.findall(log)
            saves = [float(blocked or total) for step, total, blocked in found if int(step) == ckpt_step]
    row.checkpoint_save_s = max(saves) if saves else None


# ---------------------------------------------------------------- the three parts


def run_strategy(name: str, sizes: Sizes, gpus: int, launcher: Launcher, work: Path, keep: bool) -> Row:
    nproc, batch, label, extra = strategy_plan(name, sizes, gpus, launcher.rehearsal)
    run_dir = work / name
    run_dir.mkdir(parents=True)
    ckpt = sizes.checkpoint_step
    overrides = trainer_overrides(name, sizes, batch, sizes.steps, sizes.log_every, ckpt) + extra
    row = Row(name, nproc, label, sizes.batch_size * gpus, run_dir=str(run_dir), overrides=overrides)
    print(f"--- {name}: {label}, batch {batch} per replica, {sizes.steps} steps ... ", end="", flush=True)
    started = time.perf_counter()
    procs = launcher.start(["-m", "ddp_core", str(CHARLM), *overrides, "--run-dir", str(run_dir)], nproc, run_dir)
    failed, reason = launcher.wait(procs)
    row.wall_s = time.perf_counter() - started
    if failed is None and not DIGEST.search((run_dir / "rank0.log").read_text(errors="replace")):
        failed, reason = 0, "exited 0 without a final weights digest"
    if failed is not None:
        fail(row, reason, run_dir / f"rank{failed}.log")
    else:
        measure(row, run_dir, sizes, ckpt)
        print(f"{row.wall_s:.0f} s", flush=True)
    if not keep:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return row


def fail(row: Row, reason: str, log: Path) -> None:
    row.status, row.error = "FAILED", reason
    print(f"FAILED ({reason}); last lines of {log}:\n{tail(log)}", flush=True)


def run_baseline(sizes: Sizes, gpus: int, launcher: Launcher, work: Path, kind: str = "ddp") -> Row:
    name, script = BASELINES[kind]
    out_dir = work / script.stem
    out_dir.mkdir(parents=True)
    where = "CPU" if launcher.rehearsal else plural(gpus, "GPU")
    label = f"{plural(gpus, 'rank')} / {where}"
    row = Row(name, gpus, label, sizes.batch_size * gpus, run_dir=str(out_dir))
    print(f"--- {name} (bench/{script.name}): {label}, {sizes.steps} steps ... ", end="", flush=True)
    argv = [str(script), f"--d-model={sizes.d_model}", f"--layers={sizes.layers}", f"--heads={sizes.heads}",
            f"--seq-len={sizes.seq_len}", f"--max-chars={sizes.max_chars}", f"--eval-fraction={sizes.eval_fraction}",
            f"--batch-size={sizes.batch_size}", f"--steps={sizes.steps}", f"--window-start={sizes.window_start}",
            f"--lr={LR}", f"--weight-decay={WEIGHT_DECAY}", f"--out={out_dir / 'timing.json'}"]  # fmt: skip
    started = time.perf_counter()
    failed, reason = launcher.wait(launcher.start(argv, gpus, out_dir))
    row.wall_s = time.perf_counter() - started
    if failed is None and not (out_dir / "timing.json").exists():
        failed, reason = 0, "exited 0 without writing timing.json"
    if failed is not None:
        fail(row, reason, out_dir / f"rank{failed}.log")
        return row
    timing = json.loads((out_dir / "timing.json").read_text())
    row.window_steps = timing["window"][1] - timing["window"][0]
    row.ms_per_step = timing["ms_per_step"]
    row.samples_per_s = row.global_batch * 1000 / row.ms_per_step
    row.peak_mem_gb = timing.get("peak_mem_gb")
    row.ratio = 1.0
    print(f"{row.wall_s:.0f} s", flush=True)
    return row


def fsdp_against_its_loop(rows: list[Row]) -> str:
    """ddpjob's fsdp against the hand-written FSDP2 loop of the same invocation, one line; empty without both."""
    ours = next((r for r in rows if r.strategy.startswith("fsdp") and r.ms_per_step), None)
    theirs = next((r for r in rows if r.strategy == BASELINES["fsdp"][0] and r.ms_per_step), None)
    if ours is None or theirs is None or ours.ms_per_step is None or theirs.ms_per_step is None:
        return ""
    ratio = ours.ms_per_step / theirs.ms_per_step
    met = "met" if ratio <= FSDP_TARGET else "NOT met"
    return (f"fsdp vs hand-written FSDP2 (bench/fsdp_baseline.py): {ours.ms_per_step:.1f} vs {theirs.ms_per_step:.1f} "
            f"ms/step = {ratio:.3f}x (target <= {FSDP_TARGET:.2f}x: {met})")  # fmt: skip


def run_resume(sizes: Sizes, gpus: int, launcher: Launcher, work: Path, keep: bool) -> tuple[bool, str]:
    """ddp, deterministic: A uninterrupted, B stopped by SIGUSR2 halfway and resumed from its directory.
    Returns (ok, the line to print)."""
    steps = sizes.resume_steps
    overrides = trainer_overrides("resume", sizes, sizes.batch_size, steps, 1, 0)
    overrides += ["train.deterministic=true", "strategy.name=ddp", f"slurm.tasks_per_node={gpus}",
                  # B stops itself at a chosen batch; the flag is exchanged every step, so it stops one step later.
                  "task.target=bench.signalled_task:SignalledCharLMTask", "train.stop_check_ms=0"]  # fmt: skip
    extra_env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    config_argv = ["-m", "ddp_core", str(CHARLM), *overrides, "--run-dir"]
    a_dir, b_dir = work / "resume_A", work / "resume_B"
    print(f"--- exact resume: ddp, {plural(gpus, 'rank')}, deterministic, {steps} steps; A ... ", end="", flush=True)
    a_dir.mkdir(parents=True)
    failed, reason = launcher.wait(launcher.start([*config_argv, str(a_dir)], gpus, a_dir, extra_env=extra_env))
    if failed is not None:
        return resume_failed("run A", reason, a_dir / f"rank{failed}.log")
    a_digests = [DIGEST.findall((a_dir / f"rank{r}.log").read_text(errors="replace")) for r in range(gpus)]
    if not all(a_digests):
        return resume_failed("run A", "no final weights digest", a_dir / "rank0.log")

    print(f"B until SIGUSR2 at step {steps // 2} ... ", end="", flush=True)
    b_dir.mkdir(parents=True)
    signal_at = extra_env | {SIGNAL_AT: str(steps // 2)}  # every rank signals itself there (bench/signalled_task.py)
    failed, reason = launcher.wait(launcher.start([*config_argv, str(b_dir)], gpus, b_dir, extra_env=signal_at),
                                   ok=(0, STOPPED_EXIT))  # fmt: skip
    if failed is not None:
        return resume_failed("run B (first part)", reason, b_dir / f"rank{failed}.log")
    first = (b_dir / "rank0.log").read_text(errors="replace")
    stopped = STOPPED.findall(first)
    if not stopped or DIGEST.search(first):
        return resume_failed("run B", "not interrupted by its signal; resume not exercised", b_dir / "rank0.log")

    print(f"stopped at {stopped[-1]}, resuming ... ", end="", flush=True)
    failed, reason = launcher.wait(launcher.start(["-m", "ddp_core", str(b_dir)], gpus, b_dir, ".resumed", extra_env))
    if failed is not None:
        return resume_failed("run B (resumed)", reason, b_dir / f"rank{failed}.resumed.log")
    b_digests = [DIGEST.findall((b_dir / f"rank{r}.resumed.log").read_text(errors="replace")) for r in range(gpus)]
    if not all(b_digests):
        return resume_failed("run B (resumed)", "no final weights digest", b_dir / "rank0.resumed.log")
    print("done", flush=True)
    if not keep:
        for d in (a_dir, b_dir):
            shutil.rmtree(d / "checkpoints", ignore_errors=True)
    a, b = {d[-1] for d in a_digests}, {d[-1] for d in b_digests}
    if len(a) == 1 and a == b:
        return True, f"exact resume: OK (digest {a.pop()}; stopped at step {stopped[-1]} of {steps}, resumed)"
    return False, f"exact resume: MISMATCH (uninterrupted {sorted(a)} vs resumed {sorted(b)}; logs in {work})"


def resume_failed(what: str, reason: str, log: Path) -> tuple[bool, str]:
    print(f"FAILED ({what}: {reason}); last lines of {log}:\n{tail(log)}", flush=True)
    return False, f"exact resume: FAILED ({what}: {reason})"


# ---------------------------------------------------------------- report


def machine_info(rehearsal: bool, launcher: Launcher) -> dict[str, Any]:
    """Versions and GPU names, read in a child process: the parent never creates a CUDA context (it would hold
    GPU 0's memory during every run)."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if rehearsal:
        return info | {"device": "CPU", "gpus": 0}
    code = (
        "import json, torch; n = torch.cuda.device_count(); v = torch.cuda.nccl.version();"
        "print(json.dumps({'names': [torch.cuda.get_device_name(i) for i in range(n)],"
        " 'nccl': '.'.join(map(str, v)) if isinstance(v, tuple) else str(v),"
        " 'capability': '.'.join(map(str, torch.cuda.get_device_capability(0)))}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launcher.env, timeout=120)
    try:
        info |= json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        info["names"], info["nccl"] = ["?"], f"? ({proc.stderr.strip()[-200:]})"
    return info


def fmt(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(rows: list[Row], rehearsal: bool) -> str:
    header = ["strategy", "ranks/GPUs", "samples/s", "ms/step", "ratio vs hand-written DDP",
              "peak GPU mem (GB)", "checkpoint save (s)"]  # fmt: skip
    if rehearsal:
        header[5] = "peak mem (GB)"
    body = []
    for r in rows:
        if r.status != "ok":
            body.append([r.strategy, r.gpus, "FAILED", "-", "-", "-", "-"])
            continue
        body.append([r.strategy, r.gpus, fmt(r.samples_per_s, 0), fmt(r.ms_per_step, 1), fmt(r.ratio, 2),
                     fmt(r.peak_mem_gb, 2), fmt(r.checkpoint_save_s, 2)])  # fmt: skip
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if i >= 2 else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(b) for b in body)])


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    rehearsal = os.environ.get(CPU_ENV) == "1"
    if not rehearsal and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU here (torch {torch.__version__}, torch.cuda.is_available() = False); "
              f"nothing was run (set {CPU_ENV}=1 for a CPU rehearsal of the flow)")  # fmt: skip
        return 0
    began = time.perf_counter()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # ddp_core, when run without scripts/gpu-check
    extra_paths = ensure_omegaconf()
    gpus = 2 if rehearsal else torch.cuda.device_count()
    sizes = sizes_from(args, rehearsal)
    size_corpus(sizes, gpus)
    work = (args.work_dir or ROOT / "runs" / time.strftime("gpu-check-%Y%m%d-%H%M%S")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    launcher = Launcher(rehearsal, gpus, extra_paths, args.timeout)
    # The ranks run in their own sessions (a terminal's Ctrl-C would reach them mid-collective): on Ctrl-C or
    # SIGTERM here, kill them ourselves rather than leave them holding the GPUs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return check(args, sizes, gpus, rehearsal, launcher, work, began)
    except KeyboardInterrupt:
        print("\ngpu-check: interrupted", flush=True)
        return 130
    finally:
        kill(launcher.live)


def check(args: argparse.Namespace, sizes: Sizes, gpus: int, rehearsal: bool, launcher: Launcher, work: Path,
          began: float) -> int:  # fmt: skip
    info = machine_info(rehearsal, launcher)

    title = "CPU rehearsal, not a GPU check" if rehearsal else "GPU check"
    print(f"=== ddpjob {title} ===")
    if rehearsal:
        print(f"CPU rehearsal, not a GPU check: gloo on {os.cpu_count()} cores, 2 ranks where a GPU check uses one per "
              f"GPU; torch {info['torch']}; nothing here says anything about GPUs")  # fmt: skip
    else:
        names = info.get("names", [])
        kinds = ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
        print(f"GPUs: {gpus} ({kinds}), compute capability {info.get('capability', '?')}")
        print(f"torch {info['torch']}, CUDA {info['cuda']}, NCCL {info.get('nccl')}, Python {info['python']}")
    params = 12 * sizes.layers * sizes.d_model**2 + (2 * 256 + sizes.seq_len) * sizes.d_model
    tokens = sizes.batch_size * sizes.seq_len
    unit = "rank" if rehearsal else "GPU"
    print(f"model: char LM d_model {sizes.d_model}, {sizes.layers} layers, {sizes.heads} heads, seq {sizes.seq_len}, "
          f"~{params / 1e6:.3g}M params; batch {sizes.batch_size} per {unit} (global {sizes.batch_size * gpus} for "
          f"every strategy), ~{6 * params * tokens / 1e12:.3g} TFLOP per {unit} and step; bf16 autocast")  # fmt: skip
    print(f"runs: {sizes.steps} steps, log every {sizes.log_every}, checkpoint at step {sizes.checkpoint_step} and at "
          f"the end, eval at the end; timed window: steps {sizes.window_start}..{sizes.steps} without the checkpoint's "
          f"interval; work dir {work}", flush=True)  # fmt: skip

    rows = [run_strategy(n, sizes, gpus, launcher, work, args.keep_checkpoints) for n in args.strategies.split(",")]
    fsdp_line = ""
    if not args.no_baseline:
        baselines = [run_baseline(sizes, gpus, launcher, work, kind) for kind in BASELINES
                     if kind == "ddp" or kind in args.strategies.split(",")]  # fmt: skip
        rows[:0] = baselines
        baseline = baselines[0]
        if baseline.ms_per_step:
            for r in rows[1:]:
                r.ratio = r.ms_per_step / baseline.ms_per_step if r.ms_per_step else None
        fsdp_line = fsdp_against_its_loop(rows)
    resume_ok, resume_line = True, "exact resume: skipped (--no-resume)"
    if not args.no_resume:
        resume_ok, resume_line = run_resume(sizes, gpus, launcher, work, args.keep_checkpoints)

    wall = time.perf_counter() - began
    text = table(rows, rehearsal)
    where = plural(gpus, "rank") if rehearsal else plural(gpus, "GPU")
    print(f"\n{title}: {where}, global batch {sizes.batch_size * gpus} per step everywhere\n{text}")
    if fsdp_line:
        print(fsdp_line)
        text += f"\n\n{fsdp_line}"
    print(resume_line)
    failures = [r.strategy for r in rows if r.status != "ok"] + ([] if resume_ok else ["exact resume"])
    print(f"total wall time {wall:.0f} s; {'FAILED: ' + ', '.join(failures) if failures else 'all passed'}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(f"# ddpjob {title}\n\n{text}\n\n{resume_line}\n")
        raw = {"title": title, "machine": info, "gpus": gpus, "sizes": asdict(sizes), "rows": [asdict(r) for r in rows],
               "resume": {"ok": resume_ok, "line": resume_line}, "wall_s": wall, "work_dir": str(work),
               "failures": failures}  # fmt: skip
        (args.out / "results.json").write_text(json.dumps(raw, indent=2) + "\n")
        print(f"wrote {args.out / 'results.md'} and {args.out / 'results.json'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
