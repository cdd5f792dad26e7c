"""Fused SwiGLU activation ``silu(gate) * up`` in Triton, forward and backward.

In eager PyTorch the activation of a SwiGLU MLP (Shazeer 2020) is two kernels, ``silu`` and a
multiply, with the ``silu(gate)`` intermediate written to HBM and read back, and autograd keeps
three ``[tokens, ffn]`` tensors (``gate``, ``silu(gate)``, ``up``). The fused kernel reads
``gate`` and ``up`` once, writes the product once, and keeps only ``gate`` and ``up``: the
backward recomputes ``sigmoid(gate)``.

With ``σ = sigmoid(g)``: ``y = g σ u``, ``dg = dy · u · σ (1 + g (1 - σ))``, ``du = dy · g σ``.

Same maths as :func:`llmlab.kernels.reference.swiglu_reference`. Runs on CUDA, or on CPU tensors
under ``TRITON_INTERPRET=1`` (set before import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)
BLOCK = 1024


@triton.jit
def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # > 2^31 elements
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd(G, U, DY, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # > 2^31 elements
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=ok)
    tl.store(DU + offs, (dy * g * sig).to(DU.dtype.element_ty), mask=ok)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        _swiglu_fwd[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_bwd[(triton.cdiv(n, BLOCK),)](gate, up, dy, dg, du, n, BLOCK=BLOCK)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused ``silu(gate) * up``, differentiable; ``gate``, ``up`` same shape and dtype.

    Raises ``ValueError`` on a shape or dtype mismatch, ``RuntimeError`` for CPU tensors outside
    the interpreter.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
            f"{up.dtype} must have the same shape and dtype"
        )
    if not (gate.is_cuda or INTERPRETED):
        raise RuntimeError(
            "the Triton SwiGLU kernel needs CUDA tensors, or TRITON_INTERPRET=1 "
            "set before importing llmlab.kernels.fused_swiglu"
        )
    return _SwiGLU.apply(gate, up)
