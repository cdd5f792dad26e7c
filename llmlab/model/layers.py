"""The layers both decoder blocks use: RMSNorm and the SwiGLU MLP (the dense block's feed-forward
and each expert of the MoE block), and the weight concatenation that fuses linears for inference.

Shapes: ``B`` batch, ``T`` sequence length, ``h`` hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmlab import kernels
from llmlab.model.context import engine_cpu_fused


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in fp32 like HF Llama."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x [..., h] -> [..., h]``; with ``residual``: the norm of ``x + residual`` and that
        sum, ``(normed, x + residual)`` (the C++ CPU operator does both in one pass)."""
        cpu = engine_cpu_fused()
        if kernels.use_fused("rmsnorm", x, cpu):  # opt-in fused kernels (llmlab.kernels)
            return kernels.rms_norm(x, self.weight, self.eps, residual, cpu)
        if residual is not None:
            x = x + residual
            return self(x), x
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def concat_linears(mods: list[nn.Linear]):
    """One weight for several ``nn.Linear`` layers that read the same input: the layers' weights
    (and biases) become views of one concatenated tensor (no extra memory), so one matmul replaces
    ``len(mods)``. Returns ``(weight, bias or None, out_features of each)``, or None when a layer
    is not a plain ``nn.Linear`` (e.g. int8 weights) or the biases differ in presence. Inference
    only: the views are no longer trainable leaves."""
    if not all(type(m) is nn.Linear for m in mods) or len({m.bias is None for m in mods}) != 1:
        return None
    w = torch.cat([m.weight.data for m in mods])
    b = None if mods[0].bias is None else torch.cat([m.bias.data for m in mods])
    r = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[r : r + n], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[r : r + n], requires_grad=False)
        r += n
    return w, b, [m.weight.shape[0] for m in mods]


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, ``[B,T,h] -> [B,T,h]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.fused_gate_up = None  # (weight, bias, split) after fuse(): one gate/up matmul

    def fuse(self) -> None:
        """gate/up as one matmul over views of one weight (inference; see :func:`concat_linears`)."""
        self.fused_gate_up = concat_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cpu = engine_cpu_fused()
        if self.fused_gate_up is not None:
            w, b, split = self.fused_gate_up
            if kernels.use_fused("swiglu", x, cpu):  # the product with SwiGLU as its epilogue
                h = kernels.gate_up_swiglu(x, w, b)
                if h is not None:
                    return self.down_proj(h)
            gate, up = kernels.linear(x, w, b).split_with_sizes(split, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if kernels.use_fused("swiglu", gate, cpu):  # opt-in fused kernels (llmlab.kernels)
            return self.down_proj(kernels.swiglu(gate, up, cpu))
        return self.down_proj(F.silu(gate) * up)
