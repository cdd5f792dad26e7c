"""Weight-only int8 quantisation of linear layers, with per-output-channel scales.

Each weight row ``W[o, :]`` is stored as int8 ``q[o, :]`` with one fp32 scale
``s[o] = max|W[o, :]| / 127`` (symmetric, round to nearest), and used as ``q * s`` in the matmul
(Dettmers et al. 2022 "LLM.int8()" §3 describes the vector-wise variant; here without the outlier
decomposition). Weights take 1 byte per element plus 4 bytes per output channel instead of 4
(fp32) or 2 (bf16); activations stay in floating point. The model's embedding and, by default, the
output head stay unquantised (the head is the most sensitive layer).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """``y = x @ (q * scale[:, None]).T + bias``; ``q`` int8 ``[out, in]``, ``scale`` fp32 ``[out]``."""

    q: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale, linear.bias)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        return self.q.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(
            x, self.dequantized_weight(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )


def quantize_int8(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replace every ``nn.Linear`` (except names containing an entry of ``skip``) in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and not any(s in full for s in skip):
                setattr(module, child_name, Int8Linear.from_linear(child))
    return model


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of linear layers (float or int8 plus scales), biases excluded."""
    total = 0
    for m in model.modules():
        if isinstance(m, Int8Linear):
            total += m.q.numel() * m.q.element_size() + m.scale.numel() * m.scale.element_size()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


@torch.no_grad()
def perplexity(model: nn.Module, tokens: torch.Tensor, seq_len: int = 128, max_windows: int = 32) -> float:
    """Perplexity ``exp(mean next-token CE)`` over up to ``max_windows`` consecutive windows."""
    n = min(max_windows, (tokens.numel() - 1) // seq_len)
    if n < 1:
        raise ValueError(f"need more than {seq_len + 1} tokens, got {tokens.numel()}")
    x = tokens[: n * seq_len].view(n, seq_len)
    y = tokens[1 : n * seq_len + 1].view(n, seq_len)
    return math.exp(model(x, y).item())
