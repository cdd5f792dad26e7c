"""The online-softmax trick: softmax in one pass over blocks, with a running max and sum.

A softmax row ``softmax(x)_j = exp(x_j - m) / sum_k exp(x_k - m)`` (``m = max x`` for stability)
seems to need the whole row: the max first, then the sum, then the division. Milakov &
Gimelshein (2018, "Online normalizer calculation for softmax", §3) keep two running numbers
while blocks of the row stream past:

    m_new = max(m, max(x_block))
    l_new = l * exp(m - m_new) + sum(exp(x_block - m_new))

Rescaling by ``exp(m - m_new)`` corrects what was summed against a stale max. At the end ``m`` is
the row max and ``l`` the softmax denominator. FlashAttention (Dao et al. 2022, §3.1, Algorithm
1) applies the same rescaling to the output accumulator ``acc = sum p_j v_j``, so attention never
holds a full row of scores: only one ``[block_m, block_n]`` tile at a time.

Everything here is plain PyTorch, meant to be read next to ``labs/09_kernels.ipynb``.
"""
from __future__ import annotations

import torch


def online_softmax_steps(x: torch.Tensor, block_size: int) -> list[dict]:
    """Run the online softmax over the last dim of ``x [..., N]`` in blocks of ``block_size``.

    Returns one dict per block with the running ``m`` and ``l`` (shape ``x.shape[:-1]``) after
    that block, the block's ``start``/``stop`` columns and the ``rescale`` factor
    ``exp(m_old - m_new)`` applied to the sum so far. Raises ``ValueError`` if
    ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    x = x.float()
    m = torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=x.device)
    l = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    steps = []
    for start in range(0, x.shape[-1], block_size):
        blk = x[..., start:start + block_size]
        m_new = torch.maximum(m, blk.amax(-1))
        rescale = torch.exp(m - m_new)          # exp(-inf) = 0 on the first block
        l = l * rescale + torch.exp(blk - m_new[..., None]).sum(-1)
        m = m_new
        steps.append({"start": start, "stop": start + blk.shape[-1], "m": m.clone(),
                      "l": l.clone(), "rescale": rescale})
    return steps


def online_softmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Softmax over the last dim of ``x [..., N]`` from the one-pass statistics (fp32 result).

    Equals ``torch.softmax(x.float(), -1)`` up to rounding; the row is read block by block
    for the statistics, then once more to write the probabilities.
    """
    last = online_softmax_steps(x, block_size)[-1]
    return torch.exp(x.float() - last["m"][..., None]) / last["l"][..., None]


def online_softmax_matmul(x: torch.Tensor, v: torch.Tensor, block_size: int) -> torch.Tensor:
    """``softmax(x) @ v`` in one pass, never normalising a full row (FlashAttention's inner loop).

    ``x [M, N]`` scores, ``v [N, D]`` values; returns ``[M, D]`` fp32. The output accumulator is
    rescaled by the same ``exp(m_old - m_new)`` as the running sum, and divided by ``l`` once at
    the end.
    """
    x, v = x.float(), v.float()
    m = torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=x.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(x.shape[0], v.shape[-1], dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[-1], block_size):
        blk = x[:, start:start + block_size]
        m_new = torch.maximum(m, blk.amax(-1))
        rescale = torch.exp(m - m_new)
        p = torch.exp(blk - m_new[:, None])
        l = l * rescale + p.sum(-1)
        acc = acc * rescale[:, None] + p @ v[start:start + block_size]
        m = m_new
    return acc / l[:, None]
