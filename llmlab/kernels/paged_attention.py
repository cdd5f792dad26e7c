"""PagedAttention in Triton: attention that reads K/V through block tables (decode and prefill).

Source: vLLM's PagedAttention kernel (Kwon et al., SOSP 2023, §4.1). The keys and values of a
sequence lie in fixed-size blocks scattered over a pool ``[num_blocks, block_size, Hkv, D]``;
the kernel walks the sequence's block table and never gathers the cache into a contiguous copy
(the PyTorch reference, :func:`llmlab.inference.paged_attention.paged_attention_reference`,
does gather it, padded to the longest context of the step).

Work split: one program per (sequence, KV head, tile of query rows). A tile's rows are pairs
(new token ``j`` of the sequence, query head ``g`` of the KV head's group), so with grouped-query
attention every K/V element loaded from memory serves all ``H / Hkv`` query heads that share it.
In a decode step a sequence has one new token and the tile is that token's group of heads
(padded to 16 rows, the smallest ``tl.dot`` tile). The program streams the context
``BLOCK_N`` tokens at a time: token ``t`` lives in block ``block_table[t // block_size]`` at
offset ``t % block_size`` (so ``BLOCK_N`` may span several cache blocks, or part of one), and an
online softmax (running max ``m``, running sum ``l``, rescaled accumulator, as in FlashAttention)
folds each tile in. Query ``j`` sits at position ``context_len - query_len + j`` and sees keys
at positions ``<=`` that (causal); tiles wholly in the future of every row of the program are
not read. The context need not be a multiple of ``block_size`` or of ``BLOCK_N`` (masked loads).

Not done here: splitting one long context over several programs (FlashDecoding / vLLM's
PagedAttention V2), which matters when sequences x KV heads is far below the number of SMs.

Runs on CUDA, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module was
imported (Triton's interpreter: correctness tests only, never timing).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton import knobs

#: True when the kernel below was built for Triton's CPU interpreter (TRITON_INTERPRET=1).
INTERPRETED = bool(knobs.runtime.interpret)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _paged_attention(Q, KC, VC, O, TABLES, CTX, QLEN, QSTART, sm_scale,
                     sqn, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, son, soh, sod,
                     stb, stn,
                     GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    s = tl.program_id(0)  # sequence
    hk = tl.program_id(1)  # KV head
    pid_m = tl.program_id(2)  # tile of (token, head-in-group) query rows
    ctx = tl.load(CTX + s).to(tl.int32)
    qlen = tl.load(QLEN + s).to(tl.int32)
    q0 = tl.load(QSTART + s).to(tl.int32)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = rows // GROUP  # new token of the sequence
    h = hk * GROUP + rows % GROUP  # query head
    row_ok = j < qlen
    pos = ctx - qlen + j  # position of query row in the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + (q0 + j)[:, None] * sqn + h[:, None] * sqh + offs_d[None, :] * sqd,
        mask=row_ok[:, None],
        other=0.0,
    )

    # Keys beyond the last row's position are in every row's future: not read. A tile with no
    # row (pid_m past this sequence's queries) reads nothing.
    last_j = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, qlen - 1)
    hi = tl.where(pid_m * BLOCK_M < qlen * GROUP, ctx - qlen + last_j + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, hi, BLOCK_N):
        t = start + offs_n  # token positions of this tile
        t_ok = t < hi
        blk = tl.load(TABLES + s * stb + (t // BLOCK_SIZE) * stn, mask=t_ok, other=0)
        slot = t % BLOCK_SIZE
        k_ptr = KC + blk.to(tl.int64) * skb + slot * sks + hk * skh
        v_ptr = VC + blk.to(tl.int64) * svb + slot * svs + hk * svh
        k = tl.load(k_ptr[:, None] + offs_d[None, :] * skd, mask=t_ok[:, None], other=0.0)
        v = tl.load(v_ptr[:, None] + offs_d[None, :] * svd, mask=t_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * sm_scale
        valid = t_ok[None, :] & (t[None, :] <= pos[:, None])
        scores = tl.where(valid, scores, float("-inf"))
        # Every row sees key 0 (pos >= 0), so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # rows past the queries: not stored
    tl.store(
        O + (q0 + j)[:, None] * son + h[:, None] * soh + offs_d[None, :] * sod,
        acc.to(O.dtype.element_ty),
        mask=row_ok[:, None],
    )


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
) -> None:
    """Shape / dtype / device checks of :func:`paged_attention_triton` (no host-device sync).

    Raises ``ValueError`` naming the violated constraint."""
    if q.dim() != 3:
        raise ValueError(f"q must be [N, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must "
            f"both be [num_blocks, block_size, num_kv_heads, head_dim]"
        )
    N, H, D = q.shape
    _, block_size, Hkv, Dc = k_cache.shape
    if Dc != D:
        raise ValueError(f"cache head_dim={Dc} must equal the query head_dim={D}")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(
            f"head_dim={D} must be a power of two in [16, 256] for the Triton "
            f"PagedAttention kernel (tl.dot tile); use paged_attention_reference"
        )
    if H % Hkv:
        raise ValueError(f"num_kv_heads={Hkv} must divide num_heads={H}")
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES or v_cache.dtype not in DTYPES:
        raise ValueError(
            f"dtypes q {q.dtype}, cache {k_cache.dtype}/{v_cache.dtype}: each must be "
            f"one of float32, float16, bfloat16"
        )
    if (
        block_tables.dim() != 2
        or context_lens.dim() != 1
        or query_lens.dim() != 1
        or not block_tables.shape[0] == context_lens.shape[0] == query_lens.shape[0]
    ):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} must be [S, max_blocks] and "
            f"context_lens {tuple(context_lens.shape)}, query_lens "
            f"{tuple(query_lens.shape)} must be [S], same S"
        )
    for name, t in (
        ("block_tables", block_tables),
        ("context_lens", context_lens),
        ("query_lens", query_lens),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if N < block_tables.shape[0]:
        raise ValueError(
            f"q has {N} tokens for {block_tables.shape[0]} sequences: every sequence "
            f"needs at least one new token"
        )
    for name, t in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("context_lens", context_lens),
        ("query_lens", query_lens),
    ):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all must share a device")
        if not (t.is_cuda or INTERPRETED):
            raise RuntimeError(
                "the Triton PagedAttention kernel needs CUDA tensors, or "
                "TRITON_INTERPRET=1 set before importing llmlab.kernels."
                "paged_attention (CPU interpreter)"
            )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over the paged K/V cache, in Triton.

    Same arguments and result as the reference
    (:func:`llmlab.inference.paged_attention.paged_attention_reference`): ``q [N, H, D]``, the
    ``S`` sequences' new tokens concatenated in order (``N = query_lens.sum()``);
    ``k_cache, v_cache [num_blocks, block_size, Hkv, D]`` (``Hkv`` divides ``H``, any strides);
    ``block_tables [S, max_blocks]`` int32/int64 block ids (entries past a sequence's last
    block are never read); ``context_lens [S]`` tokens cached per sequence *including* the new
    ones (already written, :func:`~llmlab.inference.paged_attention.write_kv`); ``query_lens [S]``
    new tokens per sequence. Query ``j`` of sequence ``s`` sits at position
    ``context_lens[s] - query_lens[s] + j`` and sees keys at positions ``<=`` it.
    ``scale`` defaults to ``1/sqrt(D)``. Returns ``[N, H, D]`` in ``q.dtype`` (fp32 accumulation;
    fp32 inputs use IEEE fp32 dots, no TF32).

    A decode step (``N == S``: one token per sequence) launches without reading anything back
    to the host; a step with longer queries reads ``query_lens.max()`` for the grid.
    ``block_n``: tokens per K/V tile, a power of two >= 16 (independent of ``block_size``).
    Preconditions not checked (they would need a device sync): ``1 <= query_lens[s] <=
    context_lens[s] <= max_blocks * block_size`` and valid block ids.

    Raises ``ValueError`` for bad shapes, dtypes, devices or ``head_dim`` (a power of two in
    [16, 256]), ``RuntimeError`` for CPU tensors outside Triton's interpreter.
    Source: Kwon et al. 2023 "Efficient Memory Management for LLM Serving with PagedAttention", §4.1.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, query_lens)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two >= 16 (tl.dot tile)")
    N, H, D = q.shape
    S = block_tables.shape[0]
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = H // Hkv
    max_q = 1 if N == S else int(query_lens.max())
    block_m = max(16, min(64, triton.next_power_of_2(max_q * group)))
    out = torch.empty_like(q)
    if N == 0:
        return out
    qstart = torch.cumsum(query_lens, 0) - query_lens
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays fp32
    grid = (S, Hkv, triton.cdiv(max_q * group, block_m))
    _paged_attention[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        query_lens,
        qstart,
        scale,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=D,
        PRECISION=precision,
    )
    return out


def compile_variants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device,
    block_n: int = 64,
) -> int:
    """Compile (by running once on tiny inputs) every specialisation of the kernel a serving run
    with these shapes can launch: ``BLOCK_M`` in 16/32/64 (decode, short and long prefills), so
    that a benchmark's timed steps never include Triton's compilation. Returns the number of
    launches. Same errors as :func:`paged_attention_triton`."""
    group = num_heads // num_kv_heads
    runs = 0
    for max_q in sorted({1, -(-16 // group), -(-32 // group), -(-64 // group) + 1}):
        ctx = max_q + 1
        nblk = -(-ctx // block_size)
        k_cache = torch.zeros(nblk, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        q = torch.zeros(max_q + 1, num_heads, head_dim, dtype=dtype, device=device)
        tables = torch.arange(nblk, device=device).repeat(2, 1)
        if max_q == 1:  # a decode step: one query per sequence
            args = (
                q[:2],
                tables,
                torch.tensor([ctx, ctx], device=device),
                torch.tensor([1, 1], device=device),
            )
        else:  # a prefill next to a decode
            args = (
                q,
                tables,
                torch.tensor([ctx, ctx], device=device),
                torch.tensor([max_q, 1], device=device),
            )
        paged_attention_triton(args[0], k_cache, k_cache, *args[1:], block_n=block_n)
        runs += 1
    return runs
