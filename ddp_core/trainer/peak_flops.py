"""The peak FLOP/s MFU divides by: ``train.peak_tflops``, else a table of common GPUs by compute dtype (dense, no
sparsity: the vendors' data sheets), else none, and then no MFU is shown (never a made-up one). The log says which.
"""

from __future__ import annotations

from typing import Optional

import torch

from ddp_core.config import Config, Precision

# Substrings of torch.cuda.get_device_name(), most specific first -> dense TFLOP/s per dtype. "tf32": fp32 training
# with TF32 matmuls allowed (torch.backends.cuda.matmul.allow_tf32 or float32_matmul_precision below "highest").
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GB200", {"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 80.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),  # SXM
    ("H800", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("GH200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
    ("MI300X", {"bf16": 1307.0, "fp16": 1307.0, "tf32": 653.0, "fp32": 163.4}),
    ("MI250X", {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}),
)


def compute_dtype(cfg: Config) -> str:
    """The dtype of the model's matrix products: the autocast precision, fsdp's bf16, or fp32/tf32."""
    if cfg.train.precision is Precision.bf16 or cfg.strategy.mixed_precision == "bf16":
        return "bf16"
    if cfg.train.precision is Precision.fp16:
        return "fp16"
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def from_table(device_name: str, dtype: str) -> Optional[float]:
    for key, peaks in PEAK_TFLOPS:
        if key in device_name:
            return peaks.get(dtype)
    return None


def peak_tflops(cfg: Config, device: torch.device) -> tuple[Optional[float], str]:
    """(TFLOP/s of one rank's device, where that figure came from), or (None, why there is none)."""
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops, "train.peak_tflops"
    dtype = compute_dtype(cfg)
    if device.type != "cuda":
        return None, f"no peak FLOP/s for a {device.type} device (set train.peak_tflops)"
    name = torch.cuda.get_device_name(device)
    found = from_table(name, dtype)
    if found is None:
        return None, f"{name} ({dtype}) is not in the built-in table (set train.peak_tflops)"
    return found, f"the built-in table: {name}, {dtype}"
