"""PagedAttention, the PyTorch reference (Kwon et al., SOSP 2023, §4.1).

Keys and values live in a cache of fixed-size blocks, ``[num_blocks, block_size, kv_heads, D]``;
a sequence's tokens are scattered over the blocks its *block table* names. Attention gathers
them back through the table. One call serves a whole step: every sequence contributes
``query_len`` new tokens (a prompt, a prompt chunk, or one decode token) that attend causally to
its ``context_len`` cached tokens (the new ones included, written first by :func:`write_kv`).

:func:`paged_attention_reference` is readable, vectorised PyTorch: queries are padded to the
longest query of the step and keys to the longest context; a mask keeps each query to its own
sequence's past. :func:`paged_attention`, what the engine calls, dispatches: the Triton kernel
(:mod:`llmlab.kernels.paged_attention`, which walks the block tables without gathering) on CUDA
tensors when triton is installed, the reference otherwise; the engine's
``EngineConfig(paged_attention="reference" | "triton" | "cpu" | "auto")`` chooses otherwise (its
default: ``llmlab.kernels.enable(paged_attention=...)`` or ``LLMLAB_KERNELS=paged_attention=...``;
``LLMLAB_KERNELS=0``: no kernel); ``"cpu"`` is the C++ kernel for CPU tensors
(:mod:`llmlab.kernels.cpu_paged_attention`), which walks the block tables in place too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import llmlab.kernels as K
from llmlab.kernels import cpu_paged_attention


def slot_mapping(block_table: list[int], positions: Iterable[int], block_size: int) -> list[int]:
    """Flat cache slot (``block * block_size + offset``) of each position of one sequence."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store ``k, v [N, kv_heads, D]`` at flat ``slots [N]`` of the caches
    ``[num_blocks, block_size, kv_heads, D]`` (in place)."""
    kvh, D = k_cache.shape[-2:]
    k_cache.view(-1, kvh, D).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, D).index_copy_(0, slots, v.to(v_cache.dtype))


@functools.cache
def _triton_installed() -> bool:
    return K.triton_available()  # find_spec once, not once per layer and step


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the Triton kernel handles these shapes and dtypes (``head_dim`` a power of two in
    [16, 256]; fp32/fp16/bf16), without importing triton."""
    D = q.shape[-1]
    ok = (torch.float32, torch.float16, torch.bfloat16)
    return 16 <= D <= 256 and not D & (D - 1) and q.dtype in ok and k_cache.dtype in ok


def kernel_for(q: torch.Tensor, k_cache: torch.Tensor, impl: str | None = None) -> str:
    """Which implementation :func:`paged_attention` runs for these tensors under the choice
    ``impl`` (the engine's ``EngineConfig.paged_attention``; default: the process-wide
    ``llmlab.kernels.settings().paged_attention``): ``"triton"``, ``"cpu"`` (the C++ kernel,
    :mod:`llmlab.kernels.cpu_paged_attention`) or ``"reference"``. ``"reference"`` never picks
    a kernel; ``"auto"`` picks Triton for CUDA tensors the kernel supports when triton is
    installed; ``"triton"`` picks it wherever Triton runs (CUDA, or CPU under
    ``TRITON_INTERPRET=1``; the kernel's own checks then raise for shapes it does not support);
    ``"cpu"`` picks the C++ kernel for CPU tensors whose head dim it is compiled for (compiled
    on first use; the reference for other head dims) and Triton, as
    ``"auto"`` does, for CUDA ones."""
    impl = impl or K.settings().paged_attention
    if impl == "reference":
        return "reference"
    if impl == "cpu" and q.device.type == "cpu":
        return "cpu" if q.shape[-1] in cpu_paged_attention.HEAD_DIMS else "reference"
    if not _triton_installed():
        return "reference"
    if impl in ("auto", "cpu"):
        return "triton" if q.is_cuda and kernel_supports(q, k_cache) else "reference"
    return "triton" if q.is_cuda or (q.device.type == "cpu" and K.triton_interpreted()) else "reference"


def walks_block_tables(q: torch.Tensor, k_cache: torch.Tensor, impl: str | None = None) -> bool:
    """Whether :func:`paged_attention` runs a kernel that reads each sequence's own blocks (no
    padding), so that one call can take prompts and decodes together (``impl``: as
    :func:`kernel_for`)."""
    return kernel_for(q, k_cache, impl) != "reference"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
    plan: "AttentionPlan | None" = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over the paged cache: the kernel
    :func:`kernel_for` names (the Triton kernel,
    :func:`llmlab.kernels.paged_attention.paged_attention_triton`, which takes no
    ``sliding_window``; the C++ CPU kernel,
    :func:`llmlab.kernels.cpu_paged_attention.paged_attention_cpu`), else
    :func:`paged_attention_reference`. Same arguments, shapes and result as
    :func:`paged_attention_reference` (``plan`` is used by the reference only; ``impl``: the
    choice, as :func:`kernel_for`); errors are those of the implementation chosen."""
    impl = kernel_for(q, k_cache, impl)
    if impl == "cpu":
        return cpu_paged_attention.paged_attention_cpu(
            q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, sliding_window
        )
    if impl == "triton" and sliding_window is None:
        from llmlab.kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale)
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, sliding_window, plan
    )


@dataclass
class AttentionPlan:
    """What :func:`paged_attention_reference` derives from a step's block tables and lengths
    alone, the same for every layer: computed once per step (:func:`plan_attention`) and reused
    by each layer's call. ``tables [S * nb]`` block ids to gather, ``T = nb * block_size`` padded
    keys; ``mask [S, max_q, T]`` (True: query may see key); ``rows [N]``: the padded query rows
    ``s * max_q + j`` of the real queries, in order (None for a decode-only step)."""

    tables: torch.Tensor
    T: int
    max_q: int
    mask: torch.Tensor
    rows: torch.Tensor | None


def plan_attention(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """The :class:`AttentionPlan` of one call (arguments as :func:`paged_attention_reference`)."""
    dev = block_tables.device
    max_ctx, max_q = int(context_lens.max()), int(query_lens.max())
    nb = -(-max_ctx // block_size)
    T = nb * block_size
    t = torch.arange(T, device=dev)
    rows = None
    if max_q == 1:  # a decode-only step: one query per sequence, no padding
        pos = (context_lens - 1)[:, None]  # [S, 1]
    else:  # pad the queries: row s holds its query_lens[s] tokens, then padding
        j = torch.arange(max_q, device=dev)
        valid = j[None, :] < query_lens[:, None]  # [S, max_q]
        rows = valid.flatten().nonzero().squeeze(1)
        pos = (context_lens - query_lens)[:, None] + j[None, :]  # [S, max_q]
    mask = t[None, None, :] <= pos[:, :, None]  # [S, max_q, T]
    if sliding_window is not None:
        mask &= t[None, None, :] > pos[:, :, None] - sliding_window
    return AttentionPlan(block_tables[:, :nb].reshape(-1), T, max_q, mask, rows)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over the paged cache, in PyTorch (gathers the
    blocks into a padded ``[S, H, max_context, D]`` copy).

    Shapes: ``q [N, H, D]`` (the ``S`` sequences' new tokens, concatenated in order, N =
    ``query_lens.sum()``); ``k_cache, v_cache [num_blocks, block_size, Hkv, D]`` with ``H`` a
    multiple of ``Hkv`` (grouped-query attention); ``block_tables [S, max_blocks]`` int64 (unused
    entries may hold any valid block id); ``context_lens [S]`` tokens in the cache for each
    sequence *including* its new ones; ``query_lens [S]``. Query ``j`` of sequence ``s`` sits at
    position ``context_lens[s] - query_lens[s] + j`` and sees keys at positions ``<=`` that.
    Returns ``[N, H, D]``. ``scale`` defaults to ``1/sqrt(D)``. ``sliding_window`` (Mistral /
    Qwen2 sliding layers, Beltagy et al. 2020): the query at position ``p`` sees only keys at
    ``p - sliding_window < t <= p`` (the cache still holds every block). ``plan``: the step's
    :func:`plan_attention` of these arguments, when the caller keeps it across layers.
    """
    N, H, D = q.shape
    S = block_tables.shape[0]
    Hkv = k_cache.shape[2]
    if plan is None:
        plan = plan_attention(block_tables, context_lens, query_lens, k_cache.shape[1], sliding_window)
    T, max_q = plan.T, plan.max_q
    k = k_cache.index_select(0, plan.tables).view(S, T, Hkv, D).transpose(1, 2)  # [S, Hkv, T, D]
    v = v_cache.index_select(0, plan.tables).view(S, T, Hkv, D).transpose(1, 2)
    if plan.rows is None:  # decode-only: one query per sequence
        qp = q[:, None]
    else:  # padded queries [S, max_q, H, D]: row s holds its tokens, then zeros
        qp = q.new_zeros(S * max_q, H, D).index_copy_(0, plan.rows, q).view(S, max_q, H, D)
    # grouped-query attention: SDPA maps H/Hkv query heads to each kv head (no copies of K/V)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        k.to(q.dtype),
        v.to(q.dtype),
        attn_mask=plan.mask[:, None],
        scale=scale,
        enable_gqa=Hkv != H,
    )  # [S, H, max_q, D]
    out = out.transpose(1, 2)
    return out[:, 0] if plan.rows is None else out.reshape(S * max_q, H, D).index_select(0, plan.rows)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The contiguous baseline for one sequence: ``q [Tq, H, D]`` are the last ``Tq`` of the
    ``T`` positions of ``k, v [T, Hkv, D]``; causal. Returns ``[Tq, H, D]``."""
    Tq, H, D = q.shape
    T, Hkv = k.shape[0], k.shape[1]
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    if Hkv != H:
        k, v = k.repeat_interleave(H // Hkv, dim=0), v.repeat_interleave(H // Hkv, dim=0)
    mask = torch.arange(T)[None, :] <= (T - Tq + torch.arange(Tq))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask.to(q.device))
    return out.transpose(0, 1)
