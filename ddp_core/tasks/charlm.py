"""Example task: a small GPT-style byte-level language model trained on the Python standard library's source.

The text is on every machine that runs the trainer, offline: the ``*.py`` files under
``sysconfig.get_paths()["stdlib"]``, sorted by path and capped at ``max_chars`` bytes, so every rank of a job
reads the same corpus (another Python version reads other text). The model is an ``nn.Sequential`` of
top-level blocks (embedding, transformer blocks, norm + head) so ``model_parallel`` can split it between them.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from ddp_core.errors import DdpJobError
from ddp_core.tasks.base import Output, Task
from ddp_core.tasks.flops import dense_params, transformer_flops_per_sample

VOCAB = 256  # bytes: no tokenizer to build or ship


def _py_files(directory: Path) -> Iterator[Path]:
    """``.py`` files depth-first in sorted name order, lazily: a small corpus lists only a few folders."""
    for entry in sorted(directory.iterdir()):
        if entry.is_dir():
            # Third-party packages may live inside the stdlib folder, and they differ between environments.
            if entry.name not in {"site-packages", "dist-packages", "__pycache__"}:
                yield from _py_files(entry)
        elif entry.suffix == ".py":
            yield entry


def stdlib_text(max_chars: int) -> bytes:
    """The first ``max_chars`` bytes of the stdlib's ``.py`` files, concatenated in a fixed order."""
    chunks, total = [], 0
    for path in _py_files(Path(sysconfig.get_paths()["stdlib"])):
        chunks.append(path.read_bytes()[: max_chars - total])
        total += len(chunks[-1])
        if total >= max_chars:
            break
    return b"".join(chunks)


class Windows(Dataset):
    """Non-overlapping windows at fixed offsets: item i is (bytes i*L .. i*L+L-1, the same shifted by one)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class Embed(nn.Module):
    """Byte and learned position embeddings: (batch, time) byte ids → (batch, time, d_model)."""

    def __init__(self, d_model: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tokens(idx) + self.positions(positions))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each added to the residual stream."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class Head(nn.Module):
    """Final norm and the projection to byte logits (untied from the embedding: they may sit on other GPUs)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise DdpJobError(f"config key '{key}' = {value!r} is invalid: {why}", f"fix it in the YAML or with {key}=...")


class CharLMTask(Task):
    @classmethod
    def check_args(cls, data: dict[str, Any], model: dict[str, Any]) -> None:
        _require(data["seq_len"] >= 1, "task.data.seq_len", data["seq_len"], "must be >= 1")
        _require(data["max_chars"] >= 2, "task.data.max_chars", data["max_chars"], "must be >= 2")
        _require(0 < data["eval_fraction"] < 1, "task.data.eval_fraction", data["eval_fraction"], "must be in (0, 1)")
        for name in ("d_model", "n_heads"):
            _require(model[name] >= 1, f"task.model.{name}", model[name], "must be >= 1")
        _require(model["n_layers"] >= 0, "task.model.n_layers", model["n_layers"], "must be >= 0")
        _require(0 <= model["dropout"] < 1, "task.model.dropout", model["dropout"], "must be in [0, 1)")
        # Checked again in build_model (a task built without the config); here it fails before the queue wait.
        _require(
            model["d_model"] % model["n_heads"] == 0,
            "task.model.n_heads",
            model["n_heads"],
            f"must divide task.model.d_model = {model['d_model']}",
        )

    def __init__(self, seq_len: int = 64, max_chars: int = 1_000_000, eval_fraction: float = 0.05) -> None:
        self.seq_len, self.max_chars, self.eval_fraction = seq_len, max_chars, eval_fraction

    def build_model(self, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, dropout: float = 0.0) -> nn.Module:
        if d_model % n_heads:
            raise DdpJobError(
                f"config key 'task.model.n_heads' = {n_heads} does not divide task.model.d_model = {d_model}",
                "pick n_heads that divides d_model",
            )
        blocks = [Block(d_model, n_heads, dropout) for _ in range(n_layers)]
        return nn.Sequential(Embed(d_model, self.seq_len, dropout), *blocks, Head(d_model))

    def flops_per_sample(self, model: nn.Module) -> float:
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        width = blocks[0].qkv.in_features if blocks else 0
        return transformer_flops_per_sample(dense_params(model), len(blocks), width, self.seq_len)

    def tokens_per_sample(self) -> int:
        return self.seq_len

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        data = torch.frombuffer(bytearray(stdlib_text(self.max_chars)), dtype=torch.uint8)
        # The eval text is the corpus's tail: no window straddles the two sets.
        cut = len(data) - int(len(data) * self.eval_fraction)
        train, held_out = Windows(data[:cut], self.seq_len), Windows(data[cut:], self.seq_len)
        if len(train) == 0 or len(held_out) == 0:
            raise DdpJobError(
                f"task.data.max_chars = {self.max_chars} leaves no {self.seq_len}-byte window for train or eval",
                "raise task.data.max_chars or lower task.data.seq_len",
            )
        return train, held_out

    def score(self, output: torch.Tensor, y: torch.Tensor) -> Output:
        logits = output.float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        if torch.is_grad_enabled():  # a training step: the trainer reads only the loss (eval runs under no_grad)
            return Output(loss=loss, count=y.numel())
        correct = (logits.argmax(dim=-1) == y).sum().float()
        return Output(loss=loss, count=y.numel(), sums={"loss": loss.detach() * y.numel(), "accuracy": correct})
