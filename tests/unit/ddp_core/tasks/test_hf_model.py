"""A Hugging Face model (``ddp_core.tasks.hf_gpt2``, a tiny random GPT2LMHeadModel) under fsdp, pipeline and
compiled ddp, and the login-node checks of how a strategy cuts a model (``ddp_core.strategies.check``), no Slurm.

Multi-rank runs are the trainer end to end under torchrun on gloo (``tests.support.helpers.run_trainer``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ddp_core.checkpoint import store as checkpoint
from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from ddp_core.strategies.check import check_model
from ddp_core.strategies.units import candidate_units, checkpoint_activations, shard_units
from ddp_core.tasks.hf_gpt2 import HFGPT2Task
from ddp_core.trainer.steps import weights_digest
from jobs.runs.export import export
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT, final_digests, run_trainer

pytest.importorskip("transformers")  # the optional extra hf (scripts/setup installs it)

CONFIGS = ROOT / "configs"
MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2}
TINY = [f"task.model.{k}={v}" for k, v in MODEL.items()] + [
    "task.data.seq_len=16", "task.data.max_chars=40000", "train.eval_every=0", "train.log_every=2",
    "wandb.mode=disabled", "optim.warmup_steps=0", "data.eval_batch_size=64",
]  # fmt: skip
TASK = HFGPT2Task(seq_len=16, max_chars=40000)


def hf(config: str, run_dir: Path, *overrides: str, nproc: int = 2, torchrun: bool = False) -> str:
    return run_trainer(str(CONFIGS / config), run_dir, [*TINY, *overrides], nproc, torchrun=torchrun)


def drop_checkpoints_after(run_dir: Path, step: int) -> None:
    for path in (run_dir / "checkpoints").glob("step_*"):
        if int(path.name[5:13]) > step:
            checkpoint.remove_data(path)


def final_eval_loss(log: str) -> float:
    return float(re.findall(r"finished at step \d+ in [\d.]+ s: accuracy [\d.]+ loss ([\d.]+)", log)[-1])


def test_fsdp_resumes_exactly_exports_a_plain_gpt2_and_activation_checkpointing_changes_no_bit(tmp_path):
    """FSDP shards each block; a run resumed mid-epoch ends with the uninterrupted run's weights, and so does the
    same run with activation checkpointing (recomputation replays the same RNG state, dropout, and the same math);
    the export is a plain GPT-2 with the trainer's last evaluation."""
    run = tmp_path / "run"
    common = ["task.model.dropout=0.1", "train.max_steps=12", "checkpoint.every_steps=4", "checkpoint.keep_last=10"]
    log = hf("hf-gpt2-fsdp.yaml", run, *common)
    assert log.count(f"fsdp: {MODEL['n_layer']} blocks + root sharded over 2 ranks") == 2, log
    ref = final_digests(log)
    assert len(ref) == 2 and len(set(ref)) == 1
    recomputed = hf("hf-gpt2-fsdp.yaml", tmp_path / "ac", *common, "strategy.activation_checkpointing=true")
    assert final_digests(recomputed) == ref
    drop_checkpoints_after(run, 4)  # as if the job died after step 4, mid-epoch
    resumed = hf("hf-gpt2-fsdp.yaml", run, *common)
    assert "resumed from step_00000004.dcp" in resumed and final_digests(resumed) == ref

    _, state = export(RunDir(run), tmp_path / "model.pt")
    assert weights_digest(state) == ref[0]
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # still one (tied) weight
    from transformers import GPT2Config, GPT2LMHeadModel

    # A fresh model from the user's own config (default attention), not the task's: the export is a plain GPT-2.
    fresh = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, bos_token_id=0, eos_token_id=0, **MODEL))
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict: plain keys
    fresh.eval()
    _, eval_set = TASK.build_datasets()
    x, y = (torch.stack(t) for t in zip(*(eval_set[i] for i in range(len(eval_set))), strict=True))
    with torch.no_grad():
        loss = TASK.score(fresh(x), y).loss.item()
    assert loss == pytest.approx(final_eval_loss(resumed), abs=1e-4)  # the trainer's last eval, same weights


def test_pipeline_matches_single_process_and_keeps_the_tied_weight_equal(tmp_path):
    same = ["task.model.dropout=0.0", "optim.name=sgd", "optim.lr=0.05", "train.max_steps=6",
            "checkpoint.every_steps=0", "optim.grad_clip=0.5", "data.batch_size=16"]  # fmt: skip
    hf("hf-gpt2.yaml", tmp_path / "single", *same, "strategy.name=ddp", nproc=1)
    log = hf("hf-gpt2-pipeline.yaml", tmp_path / "pipe", *same)
    assert "transformer.wte.weight is tied across stages [0, 1]" in log
    _, single = export(RunDir(tmp_path / "single"), tmp_path / "single.pt")
    _, pipe = export(RunDir(tmp_path / "pipe"), tmp_path / "pipe.pt")
    assert list(single) == list(pipe)
    for key in single:
        diff = (single[key] - pipe[key]).norm() / single[key].norm().clamp(min=1e-12)
        assert diff < 1e-5, (key, float(diff))
    assert torch.equal(pipe["lm_head.weight"], pipe["transformer.wte.weight"])
    # the two stages' copies are bitwise equal too: both ranks log the digest of the merged weights
    assert len(set(final_digests(log))) == 1


def test_model_parallel_runs_the_task_blocks():
    from ddp_core.cluster.env import DistEnv
    from ddp_core.config import StrategyConfig, StrategyName
    from ddp_core.strategies import build_strategy

    torch.manual_seed(0)
    model = TASK.build_model(**MODEL)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = model(x).logits
    strategy = build_strategy(
        StrategyConfig(name=StrategyName.model_parallel, split=[2, 2]), DistEnv(), torch.device("cpu"), TASK
    )
    with torch.no_grad():
        assert torch.equal(strategy.wrap(model)(x), expected)


def test_pipeline_blocks_in_order_are_the_model_forward():
    torch.manual_seed(0)
    model = TASK.build_model(**MODEL, dropout=0.1)
    x = torch.randint(0, 256, (3, 16))
    torch.manual_seed(1)
    whole = model(x).logits
    torch.manual_seed(1)
    h = x
    for block in TASK.pipeline_blocks(model):
        h = block(h)
    assert torch.equal(whole, h)


def test_compile_under_ddp_trains_resumes_and_saves_plain_keys(tmp_path):
    """The compiled model inside DistributedDataParallel, at one rank in a process group of one: DDP's hooks and the
    compiled graph's split at its buckets are those of any world size, and each rank compiles its own (~12 CPU-s
    here, the C++ compiles besides); that replicas agree is every other ddp test's."""
    run = tmp_path / "run"
    common = ["train.compile=true", "train.max_steps=8", "checkpoint.every_steps=4", "checkpoint.keep_last=10",
              "task.model.n_layer=1"]  # fmt: skip
    log = hf("hf-gpt2.yaml", run, *common, nproc=1, torchrun=True)
    assert "rank 0/1" in log and "backend gloo" in log  # under torchrun: DDP wraps the compiled model
    ref = final_digests(log)
    assert len(ref) == 1
    drop_checkpoints_after(run, 4)
    resumed = hf("hf-gpt2.yaml", run, *common, nproc=1, torchrun=True)
    assert "resumed from step_00000004" in resumed and final_digests(resumed) == ref
    _, state = export(RunDir(run), tmp_path / "model.pt")
    plain = TASK.build_model(**(MODEL | {"n_layer": 1}))  # never compiled
    plain.load_state_dict(state)  # strict: no _orig_mod. prefixes


def test_units_of_a_hugging_face_model_and_activation_checkpointing():
    torch.manual_seed(0)
    model = TASK.build_model(**MODEL)
    blocks = list(model.transformer.h)
    assert shard_units(model) == blocks  # _no_split_modules = {GPT2Block}
    assert shard_units(model, ["GPT2Block"]) == blocks
    # GPT2Model holds wte, which lm_head (outside it) shares: a tied weight stays in the root unit.
    assert shard_units(model, ["GPT2Model"]) == []
    x = torch.randint(0, 256, (2, 16))
    model(x).logits.sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    checkpoint_activations(candidate_units(model))
    model(x).logits.sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in TASK.build_model(**MODEL).named_parameters()]


# --- login node: one clear line before anything is submitted ------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "overrides", "needle"),
    [
        ("hf-gpt2-pipeline.yaml", ["task.target=tests.support.metric_tasks:HFGPT2NoBlocksTask"],
         "strategy.name='pipeline' needs an nn.Sequential model or a task whose pipeline_blocks(model) lists its "
         "blocks; GPT2LMHeadModel from HFGPT2NoBlocksTask is neither"),
        ("hf-gpt2-fsdp.yaml", ["strategy.wrap_classes=[GPT2Blok]"],
         "config key 'strategy.wrap_classes' names 'GPT2Blok', but GPT2LMHeadModel has no module of that class"),
        ("hf-gpt2.yaml", ["strategy.name=model_parallel", "slurm.gpus_per_node=2", "slurm.tasks_per_node=1"],
         "would put stages [0, 1], which share the tied parameter 'transformer.wte.weight', on different GPUs"),
        ("hf-gpt2-fsdp.yaml", ["strategy.wrap_classes=[GPT2Model]"],
         "strategy.name='fsdp' would shard GPT2LMHeadModel (16 modules with parameters) as one unit"),
        ("hf-gpt2-pipeline.yaml", ["strategy.stages=2", "strategy.split=[3,2]"],
         "'strategy.split' = [3, 2] must have 2 entries summing to 4 layers"),
    ],
)  # fmt: skip
def test_login_node_refuses_a_model_the_strategy_cannot_cut(config, overrides, needle):
    cfg = load_config(CONFIGS / config, [*TINY, *overrides])
    with pytest.raises(DdpJobError) as err:
        check_model(cfg)
    assert needle in str(err.value)


def test_dry_run_refuses_an_unsplittable_model_in_one_line(tmp_path):
    proc = run_cli("submit", str(CONFIGS / "hf-gpt2-pipeline.yaml"), "--dry-run", *TINY,
                   "task.target=tests.support.metric_tasks:HFGPT2NoBlocksTask", cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0 and "#SBATCH" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "pipeline_blocks" in line]
    assert len(errors) == 1 and "is neither" in errors[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_the_example_configs_pass_the_login_node_check():
    for name in ("hf-gpt2.yaml", "hf-gpt2-fsdp.yaml", "hf-gpt2-pipeline.yaml"):
        check_model(load_config(CONFIGS / name))


def test_compile_and_checkpointing_are_refused_where_they_do_not_apply():
    with pytest.raises(DdpJobError, match=re.escape("'train.compile' = True is invalid: works with strategy.name=ddp")):
        load_config(CONFIGS / "hf-gpt2-pipeline.yaml", ["train.compile=true"])
    with pytest.raises(DdpJobError, match=re.escape("'strategy.single_unit' = 'maybe' is invalid")):
        load_config(CONFIGS / "hf-gpt2-fsdp.yaml", ["strategy.single_unit=maybe"])
