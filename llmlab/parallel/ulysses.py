"""DeepSpeed-Ulysses: context parallelism by trading the sequence split for a head split.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models", §3. Outside attention every rank of the ``N``-rank context-parallel
group holds ``S/N`` consecutive tokens (rank ``i`` holds chunk ``i``) with all heads. Attention
needs every token of a head, not every head of a token, so one all-to-all turns
``[B, H, S/N, D]`` (sequence-sharded) into ``[B, H/N, S, D]`` (head-sharded): rank ``j`` receives
heads ``j·H/N ... (j+1)·H/N - 1`` of every rank's tokens. Each rank then runs ordinary causal
attention on whole sequences of its heads, and a second all-to-all turns the output back into
sequence shards. The backward of an all-to-all is the inverse all-to-all.

With grouped-query attention the key/value heads are split the same way, so rank ``j``'s query
heads find their key/value heads on rank ``j``: ``N`` must divide the query heads *and* the
key/value heads this rank holds (after tensor parallelism), or Ulysses is refused
(:func:`check_heads`).

Traffic, counted under ``cp_all_to_all``: per layer, q, k, v and the output each go through one
all-to-all in forward and one in backward, each rank sending its whole local tensor
(``(N-1)/N`` of it leaves the rank): :func:`ulysses_bytes_per_layer`. Unlike the ring, the volume
per rank falls as ``1/N`` for a fixed sequence length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.formulas.communication import ulysses_bytes_per_layer as ulysses_bytes_per_layer  # noqa: F401  (its bytes; re-exported)
from llmlab.runtime import comm
from llmlab.runtime.comm import Group
from typing import Any
from torch import Tensor


def check_heads(num_heads: int, num_kv_heads: int, cp: int, tp: int = 1) -> None:
    """Raise ``ValueError`` unless ``cp`` divides the query and the key/value heads per TP rank."""
    for name, n in (("query heads", num_heads), ("key/value heads", num_kv_heads)):
        per = n // tp if n >= tp else 1
        if per % cp:
            raise ValueError(
                f"--cp-mode ulysses: cp={cp} must divide the {name} per tensor-parallel "
                f"rank ({n} / tp {tp} = {per})"
            )


def ulysses_token_indices(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Positions (int64, ``[seq_len/cp]``) of the tokens rank ``cp_rank`` holds: chunk ``cp_rank``."""
    if seq_len % cp:
        raise ValueError(f"--cp-mode ulysses needs --seq-len divisible by cp={cp}, got {seq_len}")
    c = seq_len // cp
    return torch.arange(cp_rank * c, (cp_rank + 1) * c)


def _seq_to_head(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[B, H, T, D]`` (T local tokens, all heads) -> ``[B, H/N, N·T, D]`` (all tokens, H/N heads)."""
    N = comm.group_size(group)
    B, H, T, D = x.shape
    send = x.permute(1, 0, 2, 3).reshape(N, H // N, B, T, D).contiguous()  # slice j -> rank j
    recv = torch.empty_like(send)  # slice j <- rank j
    comm.all_to_all_single(recv, send, group=group, kind="cp_all_to_all")
    return recv.permute(2, 1, 0, 3, 4).reshape(B, H // N, N * T, D)


def _head_to_seq(y: torch.Tensor, group: Group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_head`: ``[B, H/N, N·T, D]`` -> ``[B, H, T, D]``."""
    N = comm.group_size(group)
    B, h, S, D = y.shape
    send = y.view(B, h, N, S // N, D).permute(2, 1, 0, 3, 4).contiguous()  # tokens of rank j -> j
    recv = torch.empty_like(send)  # heads of rank j <- j
    comm.all_to_all_single(recv, send, group=group, kind="cp_all_to_all")
    return recv.permute(2, 0, 1, 3, 4).reshape(B, N * h, S // N, D)


class SeqToHead(torch.autograd.Function):
    """All-to-all from sequence shards to head shards; its backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Any:
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        return _head_to_seq(g.contiguous(), ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """All-to-all from head shards back to sequence shards; backward is :class:`SeqToHead`'s."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, group: Group) -> Any:
        ctx.group = group
        return _head_to_seq(y, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        return _seq_to_head(g.contiguous(), ctx.group), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group) -> torch.Tensor:
    """Causal attention of this rank's consecutive tokens over the whole sequence.

    ``q [B,H,T,D]``, ``k, v [B,H_kv,T,D]`` (rank ``i`` of the group holds tokens
    ``i·T ... (i+1)·T - 1``, RoPE already applied) -> ``[B,H,T,D]``. Raises ``ValueError`` if the
    group size does not divide ``H`` and ``H_kv``.
    """
    N = comm.group_size(group)
    if q.shape[1] % N or k.shape[1] % N:
        raise ValueError(
            f"Ulysses: cp={N} must divide num_heads={q.shape[1]} and num_kv_heads={k.shape[1]} on this rank"
        )
    q, k, v = (SeqToHead.apply(t, group) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    res: torch.Tensor = HeadToSeq.apply(out, group)
    return res
