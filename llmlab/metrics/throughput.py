"""Throughput, model FLOPs and MFU.

Model FLOPs utilisation (MFU, Chowdhery et al. 2022 "PaLM", appendix B): achieved model FLOP/s
over the device's peak, with training FLOPs per token ``6N + 12·L·h·T`` (the second term is
attention's score and value matmuls; the formula is :func:`llmlab.formulas.compute.
training_flops_per_token`, re-exported here). Recomputation (activation checkpointing) is not
counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device is asked about: the formulas need none
    import torch

from llmlab.formulas.compute import training_flops_per_token

__all__ = ["PEAK_FLOPS", "mfu", "peak_flops", "training_flops_per_token"]

# Dense peak FLOP/s by device name fragment and compute dtype, from the vendors' data sheets (no
# sparsity): "bf16"/"fp16" on tensor cores, "tf32" tensor cores (fp32 matmuls with
# ``torch.backends.cuda.matmul.allow_tf32``), "fp32" on CUDA cores (PyTorch's default for fp32).
# A run is divided by the peak of ITS dtype: an fp32 run over the bf16 figure reads ~15x too low.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
    "4090": {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
}


def peak_flops(device: torch.device | str | None = None, dtype: str = "bf16") -> float | None:
    """Peak dense FLOP/s of a known CUDA GPU for ``dtype`` (``bf16``, ``fp16``, ``fp32``; fp32
    reads the TF32 tensor-core figure when ``torch.backends.cuda.matmul.allow_tf32`` is on),
    ``None`` on CPU, an unknown device, or a dtype the device has no figure for (bf16 on V100).
    Raises ``ValueError`` for another dtype."""
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"dtype {dtype!r}: expected bf16, fp16 or fp32")
    import torch

    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    name = torch.cuda.get_device_name(device)
    for key, v in PEAK_FLOPS.items():
        if key in name:
            return v.get(dtype)
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or ``None`` when the peak is unknown."""
    if not peak:
        return None
    return tokens_per_s * flops_per_token / peak
