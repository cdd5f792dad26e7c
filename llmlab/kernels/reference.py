"""PyTorch references for the Triton kernels: what each kernel must compute, and how.

* :func:`attention_reference`: causal attention with the full ``[T, T]`` score matrix
  materialised (``softmax(q k^T / sqrt(D)) v``). Autograd saves the probabilities, so the
  memory kept for backward grows as O(T²) per head.
* :func:`flash_attention_reference`: the same maths, FlashAttention's algorithm (Dao et al. 2022,
  Algorithm 1 forward, Algorithm 2 backward; the loop order of FlashAttention-2, Dao 2023, §3.1)
  written with PyTorch ops: tiles of ``block_m`` queries against tiles of ``block_n`` keys, each
  tile's partial softmax merged into the rows' running result with the log-sum-exp rule
  (:func:`llmlab.kernels.online_softmax.merge_softmax_partials`, the same function ring
  attention uses), and only ``q, k, v, out`` and the
  per-row log-sum-exp ``lse`` saved for backward: O(T) memory. The backward recomputes each score
  tile from ``q``, ``k`` and ``lse``. The Triton kernel in :mod:`llmlab.kernels.flash_attention`
  is this loop, one program per tile.
* :func:`rms_norm_reference` and :func:`swiglu_reference`: the model's own maths
  (:class:`llmlab.model.llama.RMSNorm`, :class:`llmlab.model.llama.MLP`).

Shapes: ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]`` with ``H_kv`` dividing ``H`` (grouped-query
attention: query head ``h`` reads key/value head ``h // (H // H_kv)``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmlab.kernels.online_softmax import merge_softmax_partials, softmax_partial


def check_attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate ``q [B,H,T,D]``, ``k, v [B,H_kv,T,D]``; return the group size ``H // H_kv``.

    Raises ``ValueError`` naming the broken constraint.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, H, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    B, H, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(
            f"k/v {tuple(k.shape)} must match q {tuple(q.shape)} in batch, sequence "
            f"length and head_dim (self-attention, T_q == T_k)"
        )
    if H % k.shape[1]:
        raise ValueError(f"num_kv_heads={k.shape[1]} must divide num_heads={H}")
    return H // k.shape[1]


def _expand_kv(q, k, v):
    rep = check_attention_shapes(q, k, v)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return k, v


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, sm_scale: float | None = None
) -> torch.Tensor:
    """``softmax(q k^T * sm_scale + mask) v`` with the scores materialised; returns ``[B,H,T,D]``
    in ``q.dtype``. Softmax in fp32. ``sm_scale`` defaults to ``1/sqrt(D)``."""
    k, v = _expand_kv(q, k, v)
    T, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale  # [B, H, T, T]
    if causal:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return (p @ v.float()).to(q.dtype)


class _FlashAttentionReference(torch.autograd.Function):
    """Tiled attention with online softmax; saves ``q, k, v, out, lse`` only."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_m, block_n):
        out, lse = flash_forward_tiles(q, k, v, causal, scale, block_m, block_n)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, block_m, block_n)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward_tiles(q, k, v, out, lse, dout, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _causal_tile_mask(q_start, bm, k_start, bn, device):
    rows = torch.arange(q_start, q_start + bm, device=device)[:, None]
    cols = torch.arange(k_start, k_start + bn, device=device)[None, :]
    return cols > rows  # True = masked out


def flash_forward_tiles(q, k, v, causal: bool, scale: float, block_m: int, block_n: int):
    """Forward of FlashAttention in PyTorch tiles. Returns ``out [B,H,T,D]`` (q.dtype) and
    ``lse [B,H,T]`` fp32 (the log of each row's softmax denominator, scores included ``scale``).
    ``k, v`` must already have ``H`` heads."""
    B, H, T, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    for qs in range(0, T, block_m):
        qb = q[:, :, qs : qs + block_m].float()
        bm = qb.shape[2]
        o = torch.zeros(B, H, bm, D, device=q.device)  # running (out, lse) of the rows
        row_lse = torch.full((B, H, bm), float("-inf"), device=q.device)
        kv_end = min(T, qs + bm) if causal else T  # causal: skip tiles above the diagonal
        for ks in range(0, kv_end, block_n):
            kb, vb = k[:, :, ks : ks + block_n].float(), v[:, :, ks : ks + block_n].float()
            s = (qb @ kb.transpose(-1, -2)) * scale  # one [bm, bn] tile per head
            if causal and ks + kb.shape[2] - 1 > qs:
                s = s.masked_fill(_causal_tile_mask(qs, bm, ks, kb.shape[2], q.device), float("-inf"))
            # the tile's own softmax, then the online-softmax merge into the rows' running result
            o, row_lse = merge_softmax_partials(o, row_lse, *softmax_partial(s, vb))
        out[:, :, qs : qs + bm] = o.to(q.dtype)
        lse[:, :, qs : qs + bm] = row_lse
    return out, lse


def flash_backward_tiles(q, k, v, out, lse, dout, causal: bool, scale: float, block_m: int, block_n: int):
    """Backward of FlashAttention in PyTorch tiles (FlashAttention-2 order: outer loop over key
    tiles, inner over query tiles). Each probability tile is recomputed as ``exp(s - lse)``.
    ``delta = rowsum(dout * out)`` replaces the softmax Jacobian's row sum. Returns fp32-accurate
    ``dq, dk, dv`` in the inputs' dtypes."""
    B, H, T, D = q.shape
    delta = (dout.float() * out.float()).sum(-1)  # [B, H, T]
    dq = torch.zeros(B, H, T, D, device=q.device)
    dk = torch.zeros(B, H, T, D, device=q.device)
    dv = torch.zeros(B, H, T, D, device=q.device)
    for ks in range(0, T, block_n):
        kb, vb = k[:, :, ks : ks + block_n].float(), v[:, :, ks : ks + block_n].float()
        bn = kb.shape[2]
        q_start = (ks // block_m) * block_m if causal else 0  # tiles left of the diagonal are masked
        for qs in range(q_start, T, block_m):
            qb, dob = q[:, :, qs : qs + block_m].float(), dout[:, :, qs : qs + block_m].float()
            bm = qb.shape[2]
            s = (qb @ kb.transpose(-1, -2)) * scale
            p = torch.exp(s - lse[:, :, qs : qs + bm, None])
            if causal and ks + bn - 1 > qs:
                p = p.masked_fill(_causal_tile_mask(qs, bm, ks, bn, q.device), 0.0)
            dv[:, :, ks : ks + bn] += p.transpose(-1, -2) @ dob
            dp = dob @ vb.transpose(-1, -2)
            ds = p * (dp - delta[:, :, qs : qs + bm, None])
            dk[:, :, ks : ks + bn] += (ds.transpose(-1, -2) @ qb) * scale
            dq[:, :, qs : qs + bm] += (ds @ kb) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """FlashAttention's tiled algorithm in PyTorch; same result as :func:`attention_reference`.

    ``q [B,H,T,D]``, ``k, v [B,H_kv,T,D]`` -> ``[B,H,T,D]``. Memory saved for backward:
    ``q, k, v, out`` and ``lse`` (``B·H·T`` fp32), i.e. O(T) instead of O(T²). Raises
    ``ValueError`` on inconsistent shapes or block sizes < 1.
    """
    if block_m < 1 or block_n < 1:
        raise ValueError(f"block_m={block_m} and block_n={block_n} must be >= 1")
    k, v = _expand_kv(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    return _FlashAttentionReference.apply(q, k, v, causal, scale, block_m, block_n)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``weight * x / sqrt(mean(x², -1) + eps)``, statistics in fp32 (as HF Llama); ``[..., N]``."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Shazeer 2020), elementwise; same shape as the inputs."""
    return F.silu(gate) * up
