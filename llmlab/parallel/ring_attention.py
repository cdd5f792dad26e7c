"""Ring attention: causal attention over a sequence split across the ranks of a context-parallel group.

Each of the ``N`` ranks holds ``S/N`` tokens of every sequence: its queries stay put, and the
key/value blocks travel around a ring (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise
Transformers", §3). At ring step ``s`` rank ``r`` holds the K/V block of rank ``src = (r - s) mod N``:
it posts the send of that block to rank ``r+1`` and the receive of the next one from ``r-1``,
computes its queries against the block it has (the communication runs meanwhile), and merges the
block's partial softmax into its running result with the log-sum-exp rule
(:func:`llmlab.kernels.online_softmax.merge_softmax_partials`, the rule FlashAttention uses per
tile). After ``N`` steps every query has seen every key; no rank ever holds the whole sequence.

Causal load balance (Megatron-LM's context parallelism): the sequence is cut into ``2N`` chunks
and rank ``i`` holds chunks ``i`` and ``2N-1-i`` (:func:`load_balanced_chunks`). Then every step
after the first costs every rank the same half block:

* ``s = 0``: its own block, causal mask (the two chunks are in order);
* ``src < r``: the block's first chunk (``src``) precedes both of ``r``'s chunks and its second
  chunk (``2N-1-src``) follows both: all queries against the first half of the block, no mask;
* ``src > r``: both of ``src``'s chunks lie between ``r``'s two: only ``r``'s second chunk of
  queries sees them, against the whole block, no mask.

Backward (a custom ``autograd.Function``) recomputes each block's probabilities from the saved
``lse`` (as FlashAttention's backward does) and sends the K/V blocks around the ring again, this
time with an accumulator of their gradients: each rank adds its queries' contribution ``dK, dV``
to the block it holds and passes the block's accumulator on with it; after ``N`` steps (one more
hop) each accumulator is back at the rank that owns those keys.

Traffic (counted in ``comm_bytes`` under ``cp_ring_send`` / ``cp_ring_recv``): forward ``N-1``
K/V blocks per rank, backward ``N-1`` K/V blocks plus ``N`` gradient blocks; one K/V block is
``2·B·H_kv·(S/N)·D`` elements (:func:`ring_bytes_per_layer`).

Shapes: ``q [B, H, T, D]`` and ``k, v [B, H_kv, T, D]`` are this rank's tokens (``T = S/N``, two
chunks of ``c = T/2``), already rotated by RoPE at their global positions; ``H_kv`` divides ``H``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from llmlab.kernels.online_softmax import merge_softmax_partials, softmax_partial
from llmlab.metrics.profiling import phase
from llmlab.runtime import comm
from llmlab.runtime.comm import Group
from typing import Any
from torch import Tensor

# When a list, each ring step appends ``(phase, step, what, t_start, t_end)`` (``what`` is
# ``"attention"`` for the block computation, ``"comm"`` from posting the step's transfers to
# seeing them complete: after the attention when overlapped, before it when not); the lab draws
# the timeline of communication against block attention.
TIMELINE: list[Any] | None = None

_KV_TAG, _DKV_TAG = 11, 12


def load_balanced_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two of the ``2·cp`` sequence chunks rank ``cp_rank`` holds: ``(i, 2·cp-1-i)``."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, {cp})")
    return cp_rank, 2 * cp - 1 - cp_rank


def ring_token_indices(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Positions (int64, ``[seq_len/cp]``) of the tokens rank ``cp_rank`` holds, in its order.

    Raises ``ValueError`` if ``2·cp`` does not divide ``seq_len``.
    """
    if seq_len % (2 * cp):
        raise ValueError(
            f"ring attention needs --seq-len divisible by 2*cp = {2 * cp} "
            f"(2 chunks per rank for the causal load balance); got {seq_len}"
        )
    c = seq_len // (2 * cp)
    a, b = load_balanced_chunks(cp_rank, cp)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def step_blocks(step: int, cp_rank: int, cp: int, c: int) -> tuple[slice, slice, bool]:
    """Which of this rank's query rows meet which key columns of the block held at ``step``.

    Returns ``(rows, cols, causal)``; ``c`` is the chunk length (half of the rank's tokens).
    """
    src = (cp_rank - step) % cp
    if step == 0:
        return slice(None), slice(None), True
    if src < cp_rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def block_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor]:
    """One block: ``q [B,H,M,D]`` against ``k, v [B,H_kv,N,D]`` (GQA without repeating K/V).

    Returns ``out [B,H,M,D]`` and ``lse [B,H,M]`` (fp32), normalised over this block only.
    """
    B, H, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    q5 = q.float().view(B, Hkv, H // Hkv, M, D)  # query heads grouped by kv head
    s = (q5 @ k.float()[:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, rep, M, N]
    if causal:
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out, lse = softmax_partial(s, v.float()[:, :, None])
    return out.view(B, H, M, D), lse.view(B, H, M)


def block_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *merged* ``lse`` and ``delta = rowsum(dout·out)``.

    ``p = exp(s - lse)`` are the block's entries of the full softmax, so the block's share of
    the gradient is FlashAttention's backward (Dao et al. 2022, Algorithm 2) on this block.
    Returns fp32 ``dq [B,H,M,D]``, ``dk, dv [B,H_kv,N,D]`` (summed over each kv head's group).
    """
    B, H, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    rep = H // Hkv
    q5, do5 = q.float().view(B, Hkv, rep, M, D), dout.float().view(B, Hkv, rep, M, D)
    k5, v5 = k.float()[:, :, None], v.float()[:, :, None]
    s = (q5 @ k5.transpose(-1, -2)) * scale
    p = torch.exp(s - lse.view(B, Hkv, rep, M, 1))
    if causal:
        p = p.masked_fill(torch.ones(M, N, dtype=torch.bool, device=q.device).triu(1), 0.0)
    dv = (p.transpose(-1, -2) @ do5).sum(2)
    ds = p * (do5 @ v5.transpose(-1, -2) - delta.view(B, Hkv, rep, M, 1))
    dq = (ds @ k5) * scale
    dk = (ds.transpose(-1, -2) @ q5).sum(2) * scale
    return dq.view(B, H, M, D), dk, dv


def _record(phase: str, step: int, what: str, t0: float) -> None:
    if TIMELINE is not None:
        TIMELINE.append((phase, step, what, t0, time.perf_counter()))


class _Ring:
    """The ring of one context-parallel group: this rank's place and its neighbours."""

    def __init__(self, group: Group, ranks: list[int]) -> None:
        me = dist.get_rank()
        self.group, self.n, self.r = group, len(ranks), ranks.index(me)
        self.next, self.prev = ranks[(self.r + 1) % self.n], ranks[(self.r - 1) % self.n]

    def post(
        self,
        send: Tensor | None = None,
        recv: Tensor | None = None,
        tag: int = _KV_TAG,
        extra_recv: Tensor | None = None,
        extra_send: Tensor | None = None,
    ) -> list[Any]:
        """Post (non-blocking) sends to ``next`` and receives from ``prev`` as ONE batch; returns
        the works. ``extra_send``/``extra_recv`` (the gradient accumulator passed on) come first
        on both sides, so the two ranks of a pair post in the same order (NCCL matches by order).
        Every step is one batch that pairs with the neighbours' batch of the same step: a send
        in a batch of its own would wait, under NCCL, for a receive its peer posts only after its
        own such send, all around the ring."""
        ops = []
        if extra_send is not None:
            ops.append(dist.P2POp(dist.isend, extra_send, self.next, self.group, _DKV_TAG))
        if extra_recv is not None:
            ops.append(dist.P2POp(dist.irecv, extra_recv, self.prev, self.group, _DKV_TAG))
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag))
        return comm.batch_isend_irecv(ops, kind="cp_ring")


class RingAttention(torch.autograd.Function):
    """``RingAttention.apply(q, k, v, group, ranks, scale, overlap) -> out [B,H,T,D]``.

    ``ranks``: the global ranks of the context-parallel group in ring order (this rank among
    them). ``overlap=False`` waits for each transfer before computing (the lab's baseline).
    Saves ``q, k, v, out, lse`` for backward: O(T) per rank, never an O(S²) score matrix.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        group: Group,
        ranks: list[Any],
        scale: float,
        overlap: bool = True,
    ) -> Any:
        ring = _Ring(group, ranks)
        c = q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for s in range(ring.n):
            t0, works = time.perf_counter(), []
            nxt: Tensor | None = None
            if s < ring.n - 1:
                nxt = torch.empty_like(kv)
                works = ring.post(send=kv, recv=nxt)
                if not overlap:  # the baseline: transfer, then compute
                    works = _wait(works)
                    _record("forward", s, "comm", t0)
            t1 = time.perf_counter()
            rows, cols, causal = step_blocks(s, ring.r, ring.n, c)
            with phase("ring_attention forward", step=s):
                o_b, l_b = block_attention_forward(
                    q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], scale, causal
                )
            out[:, :, rows], lse[:, :, rows] = merge_softmax_partials(
                out[:, :, rows], lse[:, :, rows], o_b, l_b
            )
            _record("forward", s, "attention", t1)
            if works:
                _wait(works)
                _record("forward", s, "comm", t0)
            if nxt is not None:
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.ranks, ctx.scale, ctx.overlap = group, ranks, scale, overlap
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = _Ring(ctx.group, ctx.ranks), ctx.scale
        c = q.shape[2] // 2
        delta = (dout.float() * out.float()).sum(-1)  # [B, H, T]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv: Tensor | None = (
            None  # the accumulator of the block last processed, passed on with the next batch
        )
        for s in range(ring.n):
            t0 = time.perf_counter()
            nxt: Tensor | None = None
            dkv_in: Tensor | None = None
            if s > 0:
                dkv_in = torch.empty((2,) + k.shape, dtype=torch.float32, device=k.device)
            if s < ring.n - 1:
                nxt = torch.empty_like(kv)
            works = ring.post(
                send=kv if nxt is not None else None, recv=nxt, extra_recv=dkv_in, extra_send=dkv
            )
            if not ctx.overlap and works:
                works = _wait(works)
                _record("backward", s, "comm", t0)
            t1 = time.perf_counter()
            rows, cols, causal = step_blocks(s, ring.r, ring.n, c)
            with phase("ring_attention backward", step=s):
                dq_b, dk_b, dv_b = block_attention_backward(
                    q[:, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    dout[:, :, rows],
                    lse[:, :, rows],
                    delta[:, :, rows],
                    scale,
                    causal,
                )
            dq[:, :, rows] += dq_b
            contrib = torch.zeros((2,) + k.shape, dtype=torch.float32, device=k.device)
            contrib[0][:, :, cols], contrib[1][:, :, cols] = dk_b, dv_b
            _record("backward", s, "attention", t1)
            if works:
                _wait(works)
                _record("backward", s, "comm", t0)
            dkv = contrib if dkv_in is None else contrib + dkv_in  # the block's accumulator
            if nxt is not None:
                kv = nxt
        if ring.n > 1:  # one more hop: home
            home = torch.empty((2,) + k.shape, dtype=torch.float32, device=k.device)
            _wait(ring.post(extra_recv=home, extra_send=dkv))
            dkv = home
        assert dkv is not None
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _wait(works: list[Any]) -> list[Any]:
    """Wait for every work (a work may be waited for only once); returns ``[]``."""
    for w in works:
        w.wait()
    return []


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    ranks: list[int],
    scale: float | None = None,
    overlap: bool = True,
) -> torch.Tensor:
    """Causal attention of this rank's load-balanced chunks over the whole sequence.

    ``q [B,H,T,D]``, ``k, v [B,H_kv,T,D]`` (``T`` even: two chunks) -> ``[B,H,T,D]``; equals
    rows :func:`ring_token_indices` of full causal attention. Raises ``ValueError`` on odd ``T``
    or ``H_kv`` not dividing ``H``.
    """
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even number of local tokens, got {q.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_kv_heads={k.shape[1]} must divide num_heads={q.shape[1]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out: torch.Tensor = RingAttention.apply(q, k, v, group, list(ranks), scale, overlap)
    return out


def ring_bytes_per_layer(
    batch: int,
    seq_len: int,
    num_kv_heads: int,
    head_dim: int,
    cp: int,
    dtype_bytes: int = 4,
    grad_bytes: int = 4,
) -> dict[str, Any]:
    """Bytes one rank sends around the ring for one attention layer (forward, backward).

    Forward: ``N-1`` K/V blocks of ``2·B·H_kv·(S/N)·D`` elements. Backward: the K/V blocks again
    (``N-1``) and ``N`` gradient accumulators (fp32 here: ``grad_bytes``).
    """
    block = 2 * batch * num_kv_heads * (seq_len // cp) * head_dim
    fwd = (cp - 1) * block * dtype_bytes
    return {"forward": fwd, "backward": fwd + cp * block * grad_bytes}
