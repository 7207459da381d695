"""Example task: a Hugging Face ``GPT2LMHeadModel``, randomly initialised from a small ``GPT2Config`` (no download),
trained as a byte-level language model on the same local text as the char LM (``ddp_core.tasks.charlm``).

What a Hugging Face model needs from ddpjob, shown in one place: ``score`` reads ``.logits`` from the model's
output; fsdp shards each ``GPT2Block`` (the model's ``_no_split_modules``); ``pipeline_blocks`` lists the model's
blocks in forward order (embeddings, each ``GPT2Block``, final norm + tied head) for pipeline and
model_parallel. ``transformers`` is the optional extra ``hf`` (``pip install 'ddpjob[hf]'``), imported only
when the model is built. See docs/models.md, "Bringing a Hugging Face model".
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from ddp_core.errors import DdpJobError
from ddp_core.tasks.base import Output, Task
from ddp_core.tasks.charlm import VOCAB, Windows, stdlib_text
from ddp_core.tasks.flops import dense_params, transformer_flops_per_sample


class Embeddings(nn.Module):
    """Token + position embeddings and dropout, as ``GPT2Model.forward`` applies them: input ids -> hidden states."""

    def __init__(self, transformer: Any) -> None:  # GPT2Model (transformers is optional: not imported here)
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class Layer(nn.Module):
    """One ``GPT2Block`` on hidden states alone (no mask: its SDPA attention is causal by itself)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class LMHead(nn.Module):
    """Final layer norm and the (tied) output projection: hidden states -> logits."""

    def __init__(self, model: Any) -> None:  # GPT2LMHeadModel
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise DdpJobError(f"config key '{key}' = {value!r} is invalid: {why}", f"fix it in the YAML or with {key}=...")


class HFGPT2Task(Task):
    @classmethod
    def check_args(cls, data: dict[str, Any], model: dict[str, Any]) -> None:
        _require(data["seq_len"] >= 1, "task.data.seq_len", data["seq_len"], "must be >= 1")
        _require(data["max_chars"] >= 2, "task.data.max_chars", data["max_chars"], "must be >= 2")
        _require(0 < data["eval_fraction"] < 1, "task.data.eval_fraction", data["eval_fraction"], "must be in (0, 1)")
        for name in ("n_layer", "n_embd", "n_head"):
            _require(model[name] >= 1, f"task.model.{name}", model[name], "must be >= 1")
        _require(
            model["n_embd"] % model["n_head"] == 0,
            "task.model.n_head",
            model["n_head"],
            f"must divide task.model.n_embd = {model['n_embd']}",
        )
        _require(0 <= model["dropout"] < 1, "task.model.dropout", model["dropout"], "must be in [0, 1)")

    def __init__(self, seq_len: int = 64, max_chars: int = 1_000_000, eval_fraction: float = 0.05) -> None:
        self.seq_len, self.max_chars, self.eval_fraction = seq_len, max_chars, eval_fraction

    def build_model(
        self, n_layer: int = 2, n_embd: int = 32, n_head: int = 2, dropout: float = 0.0, tie_embeddings: bool = True
    ) -> nn.Module:
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            raise DdpJobError(
                "task.target needs the transformers package, which is not installed",
                "pip install 'ddpjob[hf]' (or pip install transformers)",
            ) from None
        config = GPT2Config(
            vocab_size=VOCAB,  # bytes
            n_positions=self.seq_len,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=tie_embeddings,
            # SDPA attention is causal without a mask: the pipeline's blocks run GPT2Block on hidden states alone.
            attn_implementation="sdpa",  # type: ignore[call-arg]  # PretrainedConfig's **kwargs take it
        )
        return GPT2LMHeadModel(config)

    def flops_per_sample(self, model: nn.Module) -> float:
        config: Any = model.config  # build_model's GPT2LMHeadModel
        # A tied head is the token embedding's table (left out by dense_params), yet it multiplies every token's
        # hidden state: count it. An untied one is an nn.Linear, counted already.
        tied = config.vocab_size * config.n_embd if config.tie_word_embeddings else 0
        n = dense_params(model) + tied
        return transformer_flops_per_sample(n, config.n_layer, config.n_embd, self.seq_len)

    def tokens_per_sample(self) -> int:
        return self.seq_len

    def pipeline_blocks(self, model: nn.Module) -> Optional[list[nn.Module]]:
        gpt2: Any = model  # build_model's GPT2LMHeadModel: its submodules by name
        return [Embeddings(gpt2.transformer), *(Layer(b) for b in gpt2.transformer.h), LMHead(gpt2)]

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        data = torch.frombuffer(bytearray(stdlib_text(self.max_chars)), dtype=torch.uint8)
        cut = len(data) - int(len(data) * self.eval_fraction)  # the eval text is the corpus's tail
        train, held_out = Windows(data[:cut], self.seq_len), Windows(data[cut:], self.seq_len)
        if len(train) == 0 or len(held_out) == 0:
            raise DdpJobError(
                f"task.data.max_chars = {self.max_chars} leaves no {self.seq_len}-byte window for train or eval",
                "raise task.data.max_chars or lower task.data.seq_len",
            )
        return train, held_out

    def score(self, output: Any, y: torch.Tensor) -> Output:
        # The whole model returns a CausalLMOutput; a pipeline's last stage returns the logits themselves.
        logits = (output.logits if hasattr(output, "logits") else output).float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        if torch.is_grad_enabled():
            return Output(loss=loss, count=y.numel())
        correct = (logits.argmax(dim=-1) == y).sum().float()
        return Output(loss=loss, count=y.numel(), sums={"loss": loss.detach() * y.numel(), "accuracy": correct})
