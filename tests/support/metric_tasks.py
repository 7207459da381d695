"""Tasks used only by tests, for what a run records and reads: its metrics, FLOPs, streamed and indexed samples,
which samples each step trained on, and annotated configs (tests/support/tasks.py: the ones that fail or hang)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ddp_core.task import Output
from ddp_core.tasks.base import Task
from ddp_core.tasks.digits import DigitsTask
from ddp_core.tasks.hf_gpt2 import HFGPT2Task
from tests.support.tasks import SignalledDigitsTask


class TrainMetricsDigitsTask(DigitsTask):
    """Digits whose training steps report metric sums too (accuracy), as eval does: logged as train/accuracy."""

    def score(self, logits: torch.Tensor, y: torch.Tensor) -> Output:
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        correct = (logits.argmax(-1) == y).sum().float()
        sums = {"loss_sum_mean": loss.detach() * len(y), "accuracy": correct}
        return Output(loss=loss, count=len(y), sums=sums)


class KnownFlopsDigitsTask(DigitsTask):
    """Digits that declares round FLOPs and tokens per sample: the MFU and tokens/s a run records can be checked by
    hand against its samples/s."""

    FLOPS = 1e6
    TOKENS = 8

    def flops_per_sample(self, model: nn.Module) -> float:
        return self.FLOPS

    def tokens_per_sample(self) -> int:
        return self.TOKENS


class FlatMetricDigitsTask(DigitsTask):
    """Digits whose evaluation also reports ``flat``, the same value at every evaluation: a monitored metric that
    never improves after its first value (early stopping)."""

    def score(self, logits: torch.Tensor, y: torch.Tensor) -> Output:
        out = super().score(logits, y)
        if not torch.is_grad_enabled():
            out.sums["flat"] = torch.tensor(float(len(y)))
        return out


class _DigitStream(torch.utils.data.IterableDataset):
    """The digits training samples as a stream of dicts, in a seeded order that changes with the epoch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.epoch = x, y, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = torch.randperm(len(self.y), generator=torch.Generator().manual_seed(1000 + self.epoch))
        for i in order.tolist():
            yield {"pixels": self.x[i], "label": self.y[i]}


class StreamDigitsTask(DigitsTask):
    """Digits served as an ``IterableDataset`` of dicts: the task's ``collate_fn`` makes (inputs, targets) batches
    (the default collate would give a dict, which ``split`` cannot unpack)."""

    def build_datasets(self) -> tuple:
        train, evals = super().build_datasets()
        x, y = train.tensors
        return _DigitStream(x, y), evals

    def collate_fn(self, samples: list) -> tuple:
        if isinstance(samples[0], dict):
            return torch.stack([s["pixels"] for s in samples]), torch.stack([s["label"] for s in samples])
        return super().collate_fn(samples)


class HFGPT2NoBlocksTask(HFGPT2Task):
    """The Hugging Face GPT-2 without its pipeline_blocks hook: a model pipeline cannot split."""

    def pipeline_blocks(self, model: nn.Module) -> None:
        return None


class IndexedSet(torch.utils.data.Dataset):
    """A dataset's samples with their index appended: (x, y, index)."""

    def __init__(self, inner: torch.utils.data.Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple:
        return (*self.inner[i], i)


class SampleLogDigitsTask(SignalledDigitsTask):
    """SignalledDigitsTask whose training batches carry their samples' indices: each rank appends every trained
    micro-batch (its indices, in order) as one JSON line to ``{log_dir}/{DDPJOB_TEST_ATTEMPT}_{rank}.jsonl``, with
    the world size. A batch seen twice in a row (DDPStrategy.prime's discarded pass, then the step itself) is
    logged once. Numerics unchanged."""

    def __init__(self, log_dir: str = "", **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.log_dir = log_dir
        self.last: object = None

    def build_datasets(self) -> tuple:
        train, evals = super().build_datasets()
        return IndexedSet(train), evals

    def split(self, batch: tuple) -> tuple:
        if len(batch) == 3:
            x, y, index = batch
            if batch is not self.last:
                self.last = batch
                rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
                path = f"{self.log_dir}/{os.environ.get('DDPJOB_TEST_ATTEMPT', 'a')}_{rank}.jsonl"
                with open(path, "a") as f:
                    f.write(json.dumps({"world": world, "samples": index.tolist()}) + "\n")
            batch = (x, y)
        return super().split(batch)


class GatedSampleLogDigitsTask(SampleLogDigitsTask):
    """SampleLogDigitsTask in a Slurm job whose attempts log apart (``a{SLURM_RESTART_COUNT}``) and whose first
    attempt stops itself at a chosen point: at its ``stop_at``-th batch rank 0 writes ``{gate_dir}/reached`` and
    waits for ``{gate_dir}/go`` (the test changes the cluster meanwhile), then sends itself the warning signal, as
    Slurm would. Later attempts never stop. Numerics unchanged."""

    def __init__(self, gate_dir: str = "", stop_at: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)
        attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        os.environ["DDPJOB_TEST_ATTEMPT"] = f"a{attempt}"  # read at each logged batch: this attempt's own files
        self.gate, self.stop_at = Path(gate_dir), (stop_at if attempt == 0 else 0)

    def split(self, batch: tuple) -> tuple:
        out = super().split(batch)  # counts the batch and logs its samples
        if self.stop_at and self.batches == self.stop_at and dist.get_rank() == 0:
            (self.gate / "reached").write_text(str(dist.get_world_size()))
            deadline = time.monotonic() + 120
            while not (self.gate / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGUSR2)
        return out


class AnnotatedTask(Task):
    """Every kind of annotation check_task reads (tests/unit/test_bad_inputs.py's rows name it as task.target)."""

    def __init__(
        self,
        path: Optional[str] = None,
        sizes: Optional[list[int]] = None,
        mode: Literal["a", "b"] = "a",
        weights: dict[str, float] | None = None,
        scale: Union[int, str] = 1,
        shape: tuple[int, int] = (1, 1),
        anything=None,  # deliberately unannotated: takes any value
    ) -> None:
        self.path = path

    def build_model(self, width: int = 8, **extra: Any) -> nn.Module:
        return nn.Linear(width, width)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        raise NotImplementedError
