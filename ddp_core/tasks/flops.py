"""FLOPs estimates a task declares for MFU (``Task.flops_per_sample``): the usual 6N + attention estimate of a
transformer's training step (PaLM, appendix B; nanoGPT's ``estimate_mfu``), and the dense parameter count it takes.

A training step of a dense model costs about 6 FLOPs per parameter per token: 2 in the forward's multiply-adds, 4
in the backward (the gradients of the activations and of the weights). Attention adds its score and value products,
which have no parameters: 12 x layers x d_model x sequence length per token (forward and backward, causal masking
ignored, as in the usual estimate). Embedding tables are lookups, not products: they count no FLOPs.
"""

from __future__ import annotations

from torch import nn


def dense_params(model: nn.Module) -> int:
    """Parameters outside ``nn.Embedding`` tables (each counted once, tied weights too)."""
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in embedded:
            seen.add(id(p))
            total += p.numel()
    return total


def transformer_flops_per_sample(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs (forward and backward) of one sequence of ``seq_len`` tokens: ``seq_len`` x (6 N + 12 L d T),
    with N the dense parameters (``dense_params``), L the layers, d the model width and T = ``seq_len``."""
    return float(seq_len) * (6.0 * n_params + 12.0 * n_layers * d_model * seq_len)


def dense_flops_per_sample(model: nn.Module) -> float:
    """Training FLOPs of one sample through a model whose products are all with its dense parameters, once per
    sample (an MLP on a feature vector): 6 N."""
    return 6.0 * dense_params(model)
