"""Strategy fsdp (FSDP2) and sharded checkpoints: equal to single-process training, sharded save/load at the same
and other world sizes, async saves, corrupt shards skipped, export to a plain state dict, exact resume (no Slurm).

Multi-rank parts run as 2 processes on gloo: ``torch.multiprocessing.spawn`` for in-process checks, torchrun
for the trainer end to end.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from ddp_core.checkpoint import sharded as sharded_checkpoint
from ddp_core.checkpoint import store as checkpoint
from ddp_core.checkpoint.manager import load_checkpoint
from ddp_core.cluster.env import DistEnv
from ddp_core.config import OptimConfig, OptimizerName, StrategyConfig, StrategyName, load_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from ddp_core.strategies import Strategy, build_strategy
from ddp_core.strategies.fsdp import shard_units
from ddp_core.tasks.charlm import CharLMTask
from ddp_core.trainer.optim import build_optimizer
from ddp_core.trainer.steps import weights_digest
from jobs.runs.export import export
from tests.support import s3 as s3_support
from tests.support.helpers import ROOT, final_digests, run_trainer
from tests.support.process_group import spawn

s3_server, s3 = s3_support.s3_server, s3_support.s3  # the fixtures

CPU = torch.device("cpu")
MODEL_ARGS = {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.0}
TASK = CharLMTask(seq_len=16)


def fsdp(rank: int = 0, world: int = 1, **options: Any) -> Strategy:
    return build_strategy(StrategyConfig(name=StrategyName.fsdp, **options), DistEnv(rank=rank, world_size=world), CPU)


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TASK.build_model(**MODEL_ARGS)


def tokens(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 256, (n, 17), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


# --- login-node validation and wrap-time errors -------------------------------------------------------------


def cfg(*overrides: str):
    return load_config(None, ["run.name=t", *overrides])


def test_config_accepts_fsdp_options():
    c = cfg("strategy.name=fsdp", "strategy.mixed_precision=bf16", "strategy.reshard_after_forward=false",
            "checkpoint.async_save=true")  # fmt: skip
    assert c.strategy.mixed_precision == "bf16" and not c.strategy.reshard_after_forward and c.checkpoint.async_save


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.name=fsdp", "strategy.mixed_precision=fp16"], "'strategy.mixed_precision' = 'fp16' is invalid"),
        (["strategy.mixed_precision=bf16"], "applies to strategy.name=fsdp only (this is 'ddp')"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(DdpJobError, match=re.escape(message)):
        cfg(*overrides)


def test_a_model_with_nothing_to_shard_fails_at_wrap():
    with pytest.raises(DdpJobError, match="nothing to shard: ReLU has no trainable parameters"):
        fsdp().wrap(nn.ReLU())


def test_shard_units_are_the_sequential_blocks_with_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert shard_units(model) == [model[0], model[2]]
    tied = nn.Sequential(model[0], nn.ReLU(), model[0])
    assert shard_units(tied) == []  # one weight in two units: only the root is sharded
    assert shard_units(nn.Linear(2, 2)) == []


def test_split_tensors_round_trip():
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    tensors, plain = sharded_checkpoint.split_tensors(state)
    assert tensors == {"model": {"w": state["model"]["w"]}}
    assert plain == {"optimizer": {"state": {}, "param_groups": state["optimizer"]["param_groups"]}}
    assert sharded_checkpoint.merge(tensors, plain) == state


def test_dcp_metadata_may_name_only_dcp_classes(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(os.system))  # unpickling would hand out os.system
    with pytest.raises(sharded_checkpoint.CheckpointRefused, match=re.escape("names 'posix.system', which is not")):
        sharded_checkpoint.read_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(sharded_checkpoint.CheckpointRefused, match=re.escape("refused: unreadable .metadata")):
        sharded_checkpoint.read_metadata(tmp_path)


# --- numerics: 2 ranks under fsdp = one process on the same global batch -----------------------------------


# SGD, not AdamW: the attention's key bias gets an exactly-zero gradient in exact arithmetic (softmax ignores a
# per-query shift), and Adam scales the rounding noise there up to full lr-sized steps, in either run.
SGD = OptimConfig(name=OptimizerName.sgd, lr=0.1, momentum=0.9)


def train_steps(model: nn.Module, strat: Strategy | None, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """SGD steps with grad clipping; ``batches`` are one step's micro-batches (accumulated)."""
    optimizer = build_optimizer(SGD, model)
    losses = []
    for _ in range(4):
        total = 0.0
        for i, batch in enumerate(batches):
            sync = strat is None or i == len(batches) - 1
            with strat.no_sync(model) if not sync else contextlib.nullcontext():
                loss = TASK.compute(model, batch).loss / len(batches)
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def _equivalence_worker(rank: int, world: int, out: str) -> None:
    x, y = tokens(8)
    mine = [(x[4 * rank + 2 * i : 4 * rank + 2 * i + 2], y[4 * rank + 2 * i : 4 * rank + 2 * i + 2]) for i in (0, 1)]
    strat = fsdp(rank, world)
    model = strat.wrap(build_model())
    losses = torch.tensor(train_steps(model, strat, mine))
    dist.all_reduce(losses)  # each rank's loss is over its half of the global batch
    full = strat.full_model_state(model)
    bf16 = fsdp(rank, world, mixed_precision="bf16")
    mixed = bf16.wrap(build_model())
    mixed_losses = train_steps(mixed, bf16, mine)
    param_dtypes = {p.dtype for p in mixed.parameters()}  # sharded master weights stay fp32
    if rank == 0:
        torch.save({"losses": losses / world, "full": full, "mixed": mixed_losses, "dtypes": str(param_dtypes)}, out)


def test_two_ranks_match_single_process_training(tmp_path):
    spawn(_equivalence_worker, 2, tmp_path, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    reference = build_model()
    ref_losses = torch.tensor(train_steps(reference, None, [tokens(8)]))  # the whole global batch at once
    torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-5, atol=0)
    ref_state = reference.state_dict()
    assert list(got["full"]) == list(ref_state)  # the plain model's keys, in its order
    for key, value in ref_state.items():
        relative = ((got["full"][key] - value).norm() / value.norm()).item()
        assert relative < 1e-5, (key, relative)
    assert not torch.equal(ref_state["0.tokens.weight"], build_model().state_dict()["0.tokens.weight"])  # it trained
    # bf16 parameters in forward/backward: close to fp32 training, fp32 master weights.
    torch.testing.assert_close(torch.tensor(got["mixed"]), ref_losses, rtol=2e-2, atol=0)
    assert got["dtypes"] == str({torch.float32})


# --- sharded checkpoints in process: round trip, async, other world sizes, export, corruption -----------------


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, seed: int) -> None:
    TASK.compute(model, tokens(4, seed=seed * 10 + rank)).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _record(strat: Strategy, model: nn.Module, rank: int, path: Path) -> None:
    """The full weights and the model's outputs on a fixed input, as they were when a checkpoint was saved."""
    full = strat.full_model_state(model)
    model.eval()
    with torch.no_grad():
        logits = model(tokens(2, seed=99)[0])
    model.train()
    if rank == 0:
        torch.save({"full": full, "logits": logits}, path)


def _save(writer: sharded_checkpoint.ShardedWriter, strat: Strategy, model, optimizer, step: int, rank: int) -> None:
    extra = {"position": {"step": step}, "world_size": dist.get_world_size()}
    writer.save(step, strat.sharded_state(model, optimizer), extra if rank == 0 else None)


def _load(strat: Strategy, directory: Path, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """A fresh model (other initial weights) and optimizer restored from the newest checkpoint."""
    model = strat.wrap(build_model(seed))
    optimizer = build_optimizer(OptimConfig(lr=1e-2), model)
    info = checkpoint.find_latest_agreed(directory)
    assert info is not None and info.kind == checkpoint.SHARDED
    rest = load_checkpoint(info, strat, model, optimizer)
    assert rest["position"] == {"step": info.step}
    return model, optimizer, info.step


def _assert_full_equal(strat: Strategy, model: nn.Module, path: Path) -> None:
    saved = torch.load(path, weights_only=True)["full"]
    full = strat.full_model_state(model)
    assert list(full) == list(saved) and all(torch.equal(full[k], saved[k]) for k in saved)


def _write_worker(rank: int, world: int, tmp: str) -> None:
    """Steps 1 (sync) and 2, 3 (async, training on while step 2 is written) at 2 ranks; step 3 loads back."""
    directory, tmp_path = Path(tmp) / "run" / "checkpoints", Path(tmp)
    strat = fsdp(rank, world)
    model = strat.wrap(build_model())
    optimizer = build_optimizer(OptimConfig(lr=1e-2), model)
    sync = sharded_checkpoint.ShardedWriter(directory, 10, async_save=False, rank=rank, world_size=world)
    background = sharded_checkpoint.ShardedWriter(directory, 10, async_save=True, rank=rank, world_size=world)
    for step, writer in ((1, sync), (2, background), (3, background)):
        _step(model, optimizer, rank, step)
        _record(strat, model, rank, tmp_path / f"saved-{step}.pt")
        _save(writer, strat, model, optimizer, step, rank)
    sync.close()
    background.close()
    fresh, fresh_optimizer, step = _load(strat, directory, seed=5)
    assert step == 3
    _assert_full_equal(strat, fresh, tmp_path / "saved-3.pt")
    expected = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    loaded = get_optimizer_state_dict(fresh, fresh_optimizer, options=StateDictOptions(full_state_dict=True))
    assert expected["param_groups"] == loaded["param_groups"]
    for name, values in expected["state"].items():
        assert all(torch.equal(values[k], loaded["state"][name][k]) for k in values), name


def _reload_worker(rank: int, world: int, tmp: str, step: int) -> None:
    """Load the newest checkpoint at this world size, check it is the saved weights, train on and save."""
    directory, tmp_path = Path(tmp) / "run" / "checkpoints", Path(tmp)
    strat = fsdp(rank, world)
    model, optimizer, loaded = _load(strat, directory, seed=7)
    assert loaded == step - 1
    _assert_full_equal(strat, model, tmp_path / f"saved-{loaded}.pt")
    _step(model, optimizer, rank, step)
    _record(strat, model, rank, tmp_path / f"saved-{step}.pt")
    writer = sharded_checkpoint.ShardedWriter(directory, 10, async_save=False, rank=rank, world_size=world)
    _save(writer, strat, model, optimizer, step, rank)


def test_sharded_checkpoints_round_trip_reshard_export_and_skip_corrupt_shards(tmp_path, caplog):
    directory = tmp_path / "run" / "checkpoints"
    spawn(_write_worker, 2, tmp_path, str(tmp_path))
    manifests = {step: checkpoint.find(directory, step) for step in (1, 2, 3)}
    assert all(info is not None and info.kind == checkpoint.SHARDED for info in manifests.values())
    assert (directory / "step_00000003.json").read_text().count('"async": true') == 1
    assert sorted(p.name for p in (directory / "step_00000003.dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt",
    ]  # fmt: skip
    assert not list(directory.glob(".*tmp*"))

    # Export: one plain state dict (weights_only) that the plain model loads strictly, with the same outputs.
    # Step 2 was written in the background while step 3 trained: it holds step 2's weights, not later ones.
    info, _ = export(RunDir(tmp_path / "run"), tmp_path / "model.pt", step=2)
    assert info.step == 2
    saved = torch.load(tmp_path / "saved-2.pt", weights_only=True)
    plain = build_model(seed=3)
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert weights_digest(plain.state_dict()) == weights_digest(saved["full"])
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens(2, seed=99)[0]), saved["logits"], rtol=1e-6, atol=1e-6)

    spawn(_reload_worker, 1, tmp_path, str(tmp_path), 4)  # 2 -> 1 rank: loads step 3, saves step 4
    assert '"world_size": 1' in (directory / "step_00000004.json").read_text()
    spawn(_reload_worker, 2, tmp_path, str(tmp_path), 5)  # 1 -> 2 ranks: loads step 4, saves step 5

    shard = directory / "step_00000005.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (directory / "step_00000004.dcp" / "__0_0.distcp").unlink()
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(directory).step == 3
    assert "sha256 mismatch in __1_0.distcp" in caplog.text and "shard file __0_0.distcp is missing" in caplog.text


def test_keep_last_prunes_sharded_folders_manifest_first(tmp_path):
    for step in (1, 2, 3):
        folder = tmp_path / f"step_{step:08d}.dcp"
        folder.mkdir()
        (folder / "x").write_bytes(b"x")
        (tmp_path / f"step_{step:08d}.json").write_text("{}")
    (tmp_path / ".step_00000004.dcp.tmp").mkdir()  # a killed save's leftovers
    checkpoint.prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003.dcp", "step_00000003.json"]


# --- the trainer end to end (torchrun / alone) -----------------------------------------------------------------

CONFIG = str(ROOT / "configs" / "charlm-fsdp.yaml")
# 57,000 training bytes: 445 windows per rank, 13 steps of 2 x 16 per epoch.
BASE = ["wandb.mode=disabled", "task.data.max_chars=60000", "train.eval_every=0", "train.log_every=4",
        "optim.warmup_steps=0", "checkpoint.keep_last=20", "train.grad_accum=2"]  # fmt: skip


def trainer(run_dir: Path, *overrides: str, nproc: int = 2) -> str:
    return run_trainer(CONFIG, run_dir, [*BASE, *overrides], nproc)


def test_resume_is_bitwise_exact_with_async_saves(tmp_path):
    # Reference: 24 steps, saved every 4 in the background. The run directory with every checkpoint after step 16
    # deleted (as if the job died there, mid-epoch 1) is resumed to the end.
    common = ["task.model.dropout=0.1", "train.max_steps=24", "checkpoint.every_steps=4", "checkpoint.async_save=true"]
    ref = final_digests(trainer(tmp_path / "run", *common))
    assert len(ref) == 2 and len(set(ref)) == 1
    for path in (tmp_path / "run" / "checkpoints").glob("step_*"):
        if int(path.name[5:13]) > 16:
            checkpoint.remove_data(path)
    log = trainer(tmp_path / "run", *common)
    assert "resumed from step_00000016.dcp (step 16, epoch 1)" in log, log
    assert final_digests(log) == ref


def test_sharded_checkpoints_in_object_storage_resume_bitwise(tmp_path, s3):
    # checkpoint.dir in S3 (moto on loopback): each rank uploads its own shards, rank 0 the manifest last. With the
    # newer checkpoints deleted from the bucket, the run resumes from step 4 there, to the same weights.
    import s3fs

    common = [
        "train.max_steps=8",
        "checkpoint.every_steps=4",
        "checkpoint.async_save=true",
        f"checkpoint.dir={s3.url()}",
    ]
    ref = final_digests(trainer(tmp_path / "run", *common))
    assert len(ref) == 2 and len(set(ref)) == 1
    assert not list((tmp_path / "run" / "checkpoints").iterdir())
    folder = f"{s3.bucket}/ckpt/{tmp_path.name}/run"
    fs = s3fs.S3FileSystem()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{folder}/step_00000008.dcp", refresh=True)) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt",
    ]  # fmt: skip
    fs.rm(f"{folder}/step_00000008.json")
    log = trainer(tmp_path / "run", *common)
    assert "resumed from step_00000004.dcp (step 4" in log, log
    assert final_digests(log) == ref
    info, _ = export(RunDir(tmp_path / "run"), f"{s3.url('exports')}/model.pt")  # read from the bucket, and back
    assert info.step == 8 and info.path == f"s3://{folder}/step_00000008.dcp"
    exported = fs.cat_file(f"{s3.bucket}/exports/model.pt")
    assert weights_digest(torch.load(io.BytesIO(exported), weights_only=True)) == ref[0]


def test_world_size_changes_and_export(tmp_path):
    run = tmp_path / "run"
    log = trainer(run, "train.max_steps=10", "checkpoint.every_steps=5")
    digest = final_digests(log)[0]
    info, _ = export(RunDir(run), tmp_path / "model.pt")
    assert info.step == 10 and info.kind == checkpoint.SHARDED
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    CharLMTask().build_model(d_model=64, n_layers=2, n_heads=4).load_state_dict(exported)  # strict: plain keys
    assert weights_digest(exported) == digest  # the digest is over the full weights, as the trainer logs it

    # The trainer continues the sharded checkpoint at another world size. (Back from 1 to 2 is the same DCP load:
    # test_sharded_checkpoints_round_trip_reshard_export_and_skip_corrupt_shards; by a trainer: test_global_batch.py.)
    log = trainer(run, "train.max_steps=15", "checkpoint.every_steps=5", nproc=1)
    assert "checkpoint was written at world size 2, now 1" in log and "resumed from step_00000010.dcp" in log
    assert "finished at step 15" in log
