"""Throughput, model FLOPs and MFU.

Model FLOPs utilisation (MFU, Chowdhery et al. 2022 "PaLM", appendix B): achieved model FLOP/s
over the device's peak, with training FLOPs per token ``6N + 12·L·h·T`` (the second term is
attention's score and value matmuls). Recomputation (activation checkpointing) is not counted.
"""
from __future__ import annotations

import torch

# Dense peak FLOP/s by device name fragment (bf16/fp16 tensor cores unless noted).
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
    "V100": 125e12, "T4": 65e12, "4090": 165e12, "3090": 71e12,
}


def training_flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """``6N + 12·L·h·T`` FLOPs to train on one token (forward + backward)."""
    return 6.0 * num_params + 12.0 * num_layers * hidden * seq_len


def peak_flops(device: torch.device | str | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of a known CUDA GPU, ``None`` on CPU or an unknown device."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    for key, v in PEAK_FLOPS.items():
        if key in name:
            return v
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or ``None`` when the peak is unknown."""
    if not peak:
        return None
    return tokens_per_s * flops_per_token / peak
