"""Lab 10 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

import torch


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Lab 10. Merge two partial attention results over disjoint sets of keys (the log-sum-exp
    rule of ring attention, Liu et al. 2023 §3; FlashAttention-2 §3.1 per tile).

    ``out_a [Q, D]`` is ``softmax(s_a) @ v_a`` normalised over key set A only, ``lse_a [Q]`` is
    ``logsumexp(s_a)`` over those keys; the same for B. A row that saw no key of a set has
    ``lse = -inf`` (and ``out = 0``) there. Return ``(out [Q, D], lse [Q])`` over A ∪ B:
    ``lse = log(exp(lse_a) + exp(lse_b))``, ``out = exp(lse_a - lse)·out_a + exp(lse_b - lse)·out_b``.
    Subtract ``max(lse_a, lse_b)`` before exponentiating (no overflow), and make a row empty in
    both sets come out as ``out = 0``, ``lse = -inf`` rather than ``nan``.
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    out = (out_a * w_a[:, None] + out_b * w_b[:, None]) / total.clamp_min(1e-30)[:, None]
    return out, m + torch.log(total)


def load_balanced_indices(seq_len: int, cp: int, rank: int) -> list[int]:
    """Lab 10. The token positions context-parallel rank ``rank`` of ``cp`` holds under causal
    load balancing (Megatron-LM context parallelism).

    Cut the sequence ``0 .. seq_len-1`` into ``2·cp`` equal chunks; rank ``i`` holds chunk ``i``
    and chunk ``2·cp-1-i``, in that order. Return the positions as a list of ints
    (``seq_len / cp`` of them). Pairing an early chunk (few keys to attend to) with a late one
    (many) gives every rank the same causal work.
    """
    c = seq_len // (2 * cp)
    a, b = rank, 2 * cp - 1 - rank
    return list(range(a * c, (a + 1) * c)) + list(range(b * c, (b + 1) * c))


def seq_to_head(x: torch.Tensor, group=None) -> torch.Tensor:
    """Lab 10. Ulysses' first all-to-all, on real ranks (Jacobs et al. 2023, §3).

    ``x [B, H, T, D]``: this rank's ``T`` consecutive tokens (rank ``r`` of ``N`` holds tokens
    ``r·T .. (r+1)·T-1``) with all ``H`` heads. Return ``[B, H/N, N·T, D]``: heads
    ``r·H/N .. (r+1)·H/N-1`` of *all* ``N·T`` tokens, in token order. Send head group ``j`` to rank
    ``j`` with one ``comm.all_to_all_single`` over ``group`` (it exchanges slices of dim 0: put
    the destination rank first), then lay the received token chunks out in rank order.
    """
    from llmlab.runtime import comm

    N = comm.group_size(group)
    B, H, T, D = x.shape
    send = x.permute(1, 0, 2, 3).reshape(N, H // N, B, T, D).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    return recv.permute(2, 1, 0, 3, 4).reshape(B, H // N, N * T, D)


EXERCISES = [merge_partials, load_balanced_indices, seq_to_head]
