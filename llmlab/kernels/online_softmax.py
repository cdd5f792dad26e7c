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

The same rule merges two *finished* partial results. A softmax-weighted sum over keys split
into two sets A and B is, per query row, ``out = (l_A out_A + l_B out_B) / (l_A + l_B)`` with
each part normalised on its own; in log space (``lse = m + log l``) that is
:func:`merge_softmax_partials`. FlashAttention's reference merges one key tile at a time
(:func:`llmlab.kernels.reference.flash_forward_tiles`), and ring attention merges the block of
keys/values each ring step brings (:mod:`llmlab.parallel.ring_attention`): one rule, one function.

Everything here is plain PyTorch, meant to be read next to ``labs/09_kernels.ipynb`` and
``labs/10_context_parallel.ipynb``.
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
        blk = x[..., start : start + block_size]
        m_new = torch.maximum(m, blk.amax(-1))
        rescale = torch.exp(m - m_new)  # exp(-inf) = 0 on the first block
        l = l * rescale + torch.exp(blk - m_new[..., None]).sum(-1)
        m = m_new
        steps.append(
            {
                "start": start,
                "stop": start + blk.shape[-1],
                "m": m.clone(),
                "l": l.clone(),
                "rescale": rescale,
            }
        )
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
        blk = x[:, start : start + block_size]
        m_new = torch.maximum(m, blk.amax(-1))
        rescale = torch.exp(m - m_new)
        p = torch.exp(blk - m_new[:, None])
        l = l * rescale + p.sum(-1)
        acc = acc * rescale[:, None] + p @ v[start : start + block_size]
        m = m_new
    return acc / l[:, None]


def merge_softmax_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets (log-sum-exp rule).

    ``out_a, out_b [..., M, D]`` are each ``softmax(s_part) @ v_part`` normalised over its own
    keys; ``lse_a, lse_b [..., M]`` fp32 are ``logsumexp(s_part)`` over those keys (``-inf`` for a
    row that saw no key). Returns ``(out, lse)`` over the union, fp32::

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

    computed against ``m = max(lse_a, lse_b)`` so nothing overflows; a row empty in both parts
    gets ``out = 0``, ``lse = -inf``. Milakov & Gimelshein 2018 §3; the form used by
    FlashAttention-2 (Dao 2023, §3.1) and ring attention (Liu et al. 2023, §3).
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both empty: weights 0, not nan
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    out = out_a.float() * w_a[..., None] + out_b.float() * w_b[..., None]
    out = out / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out, m + torch.log(total)


def softmax_partial(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's partial result: ``(softmax(s) @ v, logsumexp(s))`` over the last dim of the
    scores ``s [..., M, N]`` (``-inf`` = masked) with values ``v [..., N, D]``; fp32.

    Fully masked rows give ``out = 0`` and ``lse = -inf``, ready for
    :func:`merge_softmax_partials`.
    """
    s = s.float()
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None])  # exp(-inf) = 0 where masked
    return p @ v.float(), lse
