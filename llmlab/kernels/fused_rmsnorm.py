"""Fused RMSNorm forward and backward in Triton.

Eager PyTorch runs RMSNorm (Zhang & Sennrich 2019) as about seven kernels (cast, square, mean,
add eps, rsqrt, multiply, multiply by weight), each reading and writing a ``[rows, N]`` tensor
in HBM, and autograd keeps several of those intermediates. Fusing (one program per row) reads
``x`` once, writes ``y`` once and keeps only ``rstd`` (one fp32 per row) beside ``x`` for backward.

Forward, per row: ``rstd = 1/sqrt(mean(x²) + eps)``, ``y = w * (x * rstd)``.
Backward, with ``x̂ = x * rstd`` and ``g = dy * w``:
``dx = rstd * (g - x̂ * mean(g * x̂))`` and ``dw = Σ_rows dy * x̂``; each program sums ``dw``
over the rows it owns and the partial sums are added at the end (no atomics, deterministic).

Same maths as :func:`llmlab.kernels.reference.rms_norm_reference` (statistics in fp32). Runs on
CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)


@triton.jit
def _rms_fwd(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31 on large inputs
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    xhat = (x * rstd).to(X.dtype.element_ty).to(tl.float32)  # the model casts x̂ back first
    tl.store(Y + row * stride_y + cols, (w * xhat).to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_bwd(X, W, DY, DX, DW_PART, RSTD, stride_x, stride_dy, stride_dx, n_rows, N, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], tl.float32)
    # int64 strides: row * stride passes 2^31 on large inputs
    stride_x, stride_dy, stride_dx = stride_x.to(tl.int64), stride_dy.to(tl.int64), stride_dx.to(tl.int64)
    for row in range(pid, n_rows, step):
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, 0) / N))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=ok)
        dw += dy * xhat
    tl.store(DW_PART + pid * N + cols, dw, mask=ok)


def _rows(x):
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        N = x.shape[-1]
        x2 = _rows(x)
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(N)
        _rms_fwd[(x2.shape[0],)](
            x2, weight, y, rstd, x2.stride(0), y.stride(0), N, eps, BLOCK_N=block, num_warps=_num_warps(block)
        )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        N = x2.shape[-1]
        dy2 = _rows(dy)
        dx = torch.empty_like(x2)
        n_rows = x2.shape[0]
        progs = min(n_rows, 4 if INTERPRETED else 4 * _sm_count(x2.device))
        dw_part = torch.empty(progs, N, dtype=torch.float32, device=x2.device)
        _rms_bwd[(progs,)](
            x2,
            weight,
            dy2,
            dx,
            dw_part,
            rstd,
            x2.stride(0),
            dy2.stride(0),
            dx.stride(0),
            n_rows,
            N,
            BLOCK_N=triton.next_power_of_2(N),
            num_warps=_num_warps(triton.next_power_of_2(N)),
        )
        return dx.view(ctx.shape), dw_part.sum(0).to(weight.dtype), None


def _num_warps(block: int) -> int:
    # one row per program: spread wide rows over more warps so they fit in registers
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Fused RMSNorm: ``weight * x / sqrt(mean(x², -1) + eps)`` over the last dim, differentiable.

    ``x [..., N]``, ``weight [N]``; returns ``[..., N]`` in ``promote_types(x.dtype,
    weight.dtype)`` (as the model's eager RMSNorm). Raises ``ValueError`` if ``weight`` is not
    ``[N]``, ``RuntimeError`` for CPU tensors outside the interpreter.
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N] with N = x.shape[-1] = {x.shape[-1]}")
    if not (x.is_cuda or INTERPRETED):
        raise RuntimeError(
            "the Triton RMSNorm kernel needs CUDA tensors, or TRITON_INTERPRET=1 "
            "set before importing llmlab.kernels.fused_rmsnorm"
        )
    return _RMSNorm.apply(x, weight, float(eps))
