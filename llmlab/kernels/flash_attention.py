"""FlashAttention forward and backward in Triton (causal or not, grouped-query heads).

The algorithm is :func:`llmlab.kernels.reference.flash_attention_reference`, one Triton program
per tile (Dao et al. 2022 "FlashAttention", Algorithms 1-2; work split of FlashAttention-2,
Dao 2023, §3.1-3.2):

* forward: a program owns ``BLOCK_M`` query rows of one head, keeps ``q`` in registers and
  streams ``BLOCK_N`` keys/values at a time through an online softmax (running max ``m``, sum
  ``l``, rescaled accumulator). It writes ``out`` and ``lse = m + log(l)``; the ``[T, T]`` score
  matrix never exists in memory, neither on chip nor in HBM.
* backward, two kernels without atomics: ``_bwd_dkdv`` owns a key tile and loops over query tiles
  (accumulating ``dK``, ``dV``); ``_bwd_dq`` owns a query tile and loops over key tiles. Both
  recompute ``p = exp(q k^T * scale - lse)``; ``delta = rowsum(dO * O)`` is precomputed.
* causal: tiles entirely above the diagonal are skipped (half the work), the diagonal tile is
  masked element-wise. Sequence lengths need not be multiples of the block sizes (masked loads).
* GQA: query head ``h`` reads key/value head ``h // (H // H_kv)``; ``dK``/``dV`` are computed
  per query head and summed over each group.

Runs on CUDA, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module was
imported (Triton's interpreter: for correctness tests only, never for timing).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton import knobs

from llmlab.kernels.reference import check_attention_shapes

#: True when the kernels below were built for Triton's CPU interpreter (TRITON_INTERPRET=1).
INTERPRETED = bool(knobs.runtime.interpret)


@triton.jit
def _fwd(Q, K, V, O, LSE, sm_scale,
         sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
         H, GROUP, T, D,
         CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    # int64 offsets: B*H*T*D (or T*stride) passes 2^31 elements at long contexts
    pid_bh = tl.program_id(1).to(tl.int64)
    sqt, skt, svt, sot = sqt.to(tl.int64), skt.to(tl.int64), svt.to(tl.int64), sot.to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :] * sqd,
        mask=(rows[:, None] < T) & d_ok,
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)  # tiles above the diagonal: skipped
    else:
        hi = T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < T) & d_ok
        k = tl.load(
            K + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :] * skd, mask=kv_mask, other=0.0
        )
        v = tl.load(
            V + b * svb + hk * svh + cols[:, None] * svt + offs_d[None, :] * svd, mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        valid = cols[None, :] < T
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    row_ok = rows < T
    tl.store(
        O + b * sob + h * soh + rows[:, None] * sot + offs_d[None, :] * sod,
        acc.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok,
    )
    tl.store(LSE + pid_bh * T + rows, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale,
              sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
              sdb, sdh, sdt, sdd,
              H, GROUP, T, D,
              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    # int64 offsets: B*H*T*D (or T*stride) passes 2^31 elements at long contexts
    pid_bh = tl.program_id(1).to(tl.int64)
    sqt, skt, svt, sdt = sqt.to(tl.int64), skt.to(tl.int64), svt.to(tl.int64), sdt.to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    kv_mask = (cols[:, None] < T) & d_ok
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svt + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # query tiles left of the diagonal: skipped
    else:
        lo = 0
    for start_m in range(lo, T, BLOCK_M):
        rows = start_m + offs_m
        r_ok = rows < T
        q = tl.load(
            Q + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :] * sqd,
            mask=r_ok[:, None] & d_ok,
            other=0.0,
        )
        do = tl.load(
            DO + b * sdb + h * sdh + rows[:, None] * sdt + offs_d[None, :] * sdd,
            mask=r_ok[:, None] & d_ok,
            other=0.0,
        )
        lse = tl.load(LSE + pid_bh * T + rows, mask=r_ok, other=0.0)
        delta = tl.load(DELTA + pid_bh * T + rows, mask=r_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        valid = r_ok[:, None] & (cols[None, :] < T)
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    dk = dk * sm_scale
    # DK, DV: contiguous fp32 [B, H, T, D] (one slice per query head, summed over groups later).
    base = pid_bh * T * D + cols[:, None] * D + offs_d[None, :]
    tl.store(DK + base, dk, mask=kv_mask)
    tl.store(DV + base, dv, mask=kv_mask)


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, sm_scale,
            sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
            sdb, sdh, sdt, sdd, sxb, sxh, sxt, sxd,
            H, GROUP, T, D,
            CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    # int64 offsets: B*H*T*D (or T*stride) passes 2^31 elements at long contexts
    pid_bh = tl.program_id(1).to(tl.int64)
    sqt, skt, svt, sdt, sxt = (
        sqt.to(tl.int64),
        skt.to(tl.int64),
        svt.to(tl.int64),
        sdt.to(tl.int64),
        sxt.to(tl.int64),
    )
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    r_ok = rows < T
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :] * sqd,
        mask=r_ok[:, None] & d_ok,
        other=0.0,
    )
    do = tl.load(
        DO + b * sdb + h * sdh + rows[:, None] * sdt + offs_d[None, :] * sdd,
        mask=r_ok[:, None] & d_ok,
        other=0.0,
    )
    lse = tl.load(LSE + pid_bh * T + rows, mask=r_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh * T + rows, mask=r_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    else:
        hi = T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < T) & d_ok
        k = tl.load(
            K + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :] * skd, mask=kv_mask, other=0.0
        )
        v = tl.load(
            V + b * svb + hk * svh + cols[:, None] * svt + offs_d[None, :] * svd, mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        valid = r_ok[:, None] & (cols[None, :] < T)
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * sm_scale
    tl.store(
        DQ + b * sxb + h * sxh + rows[:, None] * sxt + offs_d[None, :] * sxd,
        dq.to(DQ.dtype.element_ty),
        mask=r_ok[:, None] & d_ok,
    )


def _launch_params(q, block_m, block_n):
    D = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(D))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays fp32 (no TF32)
    return block_d, precision


def _check_device(*tensors):
    for t in tensors:
        if not (t.is_cuda or INTERPRETED):
            raise RuntimeError(
                "the Triton flash-attention kernel needs CUDA tensors, or "
                "TRITON_INTERPRET=1 set before importing llmlab.kernels."
                "flash_attention (CPU interpreter)"
            )


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_m, block_n):
        B, H, T, D = q.shape
        group = H // k.shape[1]
        block_d, precision = _launch_params(q, block_m, block_n)
        out = torch.empty_like(q)
        lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(T, block_m), B * H)
        _fwd[grid](
            q,
            k,
            v,
            out,
            lse,
            scale,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride(),
            H,
            group,
            T,
            D,
            CAUSAL=causal,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            PRECISION=precision,
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, block_m, block_n)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, block_m, block_n = ctx.args
        B, H, T, D = q.shape
        Hk = k.shape[1]
        group = H // Hk
        block_d, precision = _launch_params(q, block_m, block_n)
        delta = (dout.float() * out.float()).sum(-1).contiguous()  # [B, H, T]
        dk = torch.empty(B, H, T, D, dtype=torch.float32, device=q.device)
        dv = torch.empty_like(dk)
        dq = torch.empty_like(q)
        common = dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision)
        _bwd_dkdv[(triton.cdiv(T, block_n), B * H)](
            q,
            k,
            v,
            dout,
            lse,
            delta,
            dk,
            dv,
            scale,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *dout.stride(),
            H,
            group,
            T,
            D,
            **common,
        )
        _bwd_dq[(triton.cdiv(T, block_m), B * H)](
            q,
            k,
            v,
            dout,
            lse,
            delta,
            dq,
            scale,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *dout.stride(),
            *dq.stride(),
            H,
            group,
            T,
            D,
            **common,
        )
        if group > 1:
            dk, dv = dk.view(B, Hk, group, T, D).sum(2), dv.view(B, Hk, group, T, D).sum(2)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Triton FlashAttention: ``softmax(q k^T * sm_scale + causal mask) v``, differentiable.

    ``q [B,H,T,D]``, ``k, v [B,H_kv,T,D]`` (``H_kv`` divides ``H``), any strides, fp32/fp16/bf16;
    returns ``[B,H,T,D]`` in ``q.dtype``. Saved for backward: ``q, k, v, out`` and ``lse``
    (``B·H·T`` fp32): O(T) memory. ``block_m``/``block_n``: tile sizes, powers of two >= 16.
    Raises ``ValueError`` on bad shapes or block sizes, ``RuntimeError`` for CPU tensors outside
    the interpreter.
    """
    check_attention_shapes(q, k, v)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two >= 16 (tl.dot tile)")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype {q.dtype} not supported (float32, float16, bfloat16)")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must be equal")
    _check_device(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    return _FlashAttention.apply(q, k, v, causal, scale, block_m, block_n)
