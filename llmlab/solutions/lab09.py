"""Lab 09 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

import torch


def online_softmax_update(
    m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, v: torch.Tensor
):
    """Lab 09. One tile of FlashAttention's online softmax (Dao et al. 2022, Alg. 1).

    State per query row: running max ``m [Q]``, running sum of exponentials ``l [Q]``, unnormalised
    output ``acc [Q, D]``. A new tile of ``scores [Q, K]`` with values ``v [K, D]`` arrives: return
    the updated ``(m, l, acc)``; ``acc / l[:, None]`` is then softmax(all scores so far) @ V.
    """
    m_new = torch.maximum(m, scores.amax(-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + p @ v


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5):
    """Lab 09. What the fused RMSNorm kernel computes in one pass (Zhang & Sennrich 2019, eq. 4;
    ``llmlab/kernels/fused_rmsnorm.py``).

    ``x [rows, N]``, ``weight [N]``. Per row, in fp32: ``rstd = 1 / sqrt(mean(x², -1) + eps)``
    (no mean is subtracted: that is LayerNorm), then ``y = x * rstd * weight``. Return
    ``(y [rows, N] in x.dtype, rstd [rows] fp32)``: ``rstd`` is the one number per row the kernel
    keeps for backward, instead of eager autograd's intermediates.
    """
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd[:, None] * weight.float()).to(x.dtype), rstd


def causal_k_tiles(q_tile: int, block_m: int, block_n: int, seq_len: int) -> dict[str, list[int]]:
    """Lab 09. Which key tiles a query tile of causal FlashAttention visits (Dao 2023,
    *FlashAttention-2*, §3.1.1 "causal masking").

    Query tile ``q_tile`` holds rows ``[q_tile*block_m, min((q_tile+1)*block_m, seq_len))``; key
    tile ``j`` holds keys ``[j*block_n, min((j+1)*block_n, seq_len))``. Query ``i`` may only see
    keys ``<= i``, so a key tile whose first key is after the tile's last query is skipped
    entirely (about half the tiles for long sequences), a tile whose last key is after the tile's
    first query is visited with the causal mask, and the others are visited unmasked. Return
    ``{"visit": [key tiles visited, ascending], "masked": [those among them that need the mask]}``.
    """
    q_last = min((q_tile + 1) * block_m, seq_len) - 1
    visit = list(range(q_last // block_n + 1))
    masked = [j for j in visit if min((j + 1) * block_n, seq_len) - 1 > q_tile * block_m]
    return {"visit": visit, "masked": masked}


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lab 09. The "dynamic range adjustment" of W8A8 inference: quantise activations per token at
    run time (Xiao et al. 2023, *SmoothQuant*, §2 "per-token"; ``llmlab/kernels/int8_linear.py``).

    ``x [N, in]`` float, one row per token. Each row gets its own scale from its measured range,
    ``sx = max|x[t, :]| / 127`` (symmetric, no zero point; an all-zero row must not give a zero
    scale: clamp the row maximum to at least ``1e-12`` first), and ``qx = round(x / sx)`` clipped
    to ``[-127, 127]``. Return ``(qx int8 [N, in], sx fp32 [N, 1])``, so that ``x ~= qx * sx``.
    """
    x = x.float()
    sx = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x / sx).clamp(-127, 127).to(torch.int8), sx


EXERCISES = [online_softmax_update, rms_norm_forward, causal_k_tiles, quantize_per_token]
