"""Fresh prompts through PyTorch's SDPA: a CPU fast path beside the C++ PagedAttention.

A sequence whose every cached token is new in this step (``query_len == context_len``: a whole
prompt, no prefix-cache hit, no earlier chunk) attends only to the K and V the step itself
computed, which lie contiguous in the step's ``k, v [N, Hkv, D]``: causal attention over its own
rows, which is what ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` computes
without reading the cache (the K/V are still written to it, for the decode steps after). On a
CPU with AMX, PyTorch's flash-attention kernel runs bf16 and fp16 through tile matrix products:
measured here, a 4,500-token step of 30 prompts (9 query heads, 3 kv heads, head_dim 64) took
14 ms a layer against the C++ kernel's 25 ms. In fp32 it is slower than the C++ kernel (38 ms),
so this path is for 16-bit dtypes on CPUs with the AMX tiles for them only (:func:`takes`: bf16
with ``amx_bf16``, fp16 with ``amx_fp16``, as :func:`llmlab.kernels.cpu_isa.effective_flags`
reports them, so ``LLMLAB_CPU_ISA`` below ``avx512_bf16`` turns it off). The other sequences of the step (decodes, later prompt
chunks) go to the paged kernel in one call, as before. Same maths as the reference
(:func:`~llmlab.inference.paged_attention.paged_attention_reference`); scores in fp32 in both.

:func:`plan_prompts` splits a batch once per step (the first layer; the others reuse it);
:func:`attend` runs one layer. ``tests/test_engine_fast_paths.py`` checks the engine's tokens and
a mixed step's outputs against the paged kernel alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AMX = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}  # where SDPA beats the C++ kernel
MIN_TOKENS = 16  # shorter prompts: the call's fixed cost is more than it saves


def takes(dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` step's fresh prompts go through SDPA on this CPU (its AMX flag for the
    dtype is in :func:`~llmlab.kernels.cpu_isa.effective_flags`)."""
    from llmlab.kernels import cpu_isa

    return dtype in AMX and AMX[dtype] in cpu_isa.effective_flags()


@dataclass
class PromptPlan:
    """One batch split: ``prompts`` the ``(start, stop)`` rows of its fresh prompts; the rest as
    a sub-batch for the paged kernel (``rest_rows [M]`` int64, their ``block_tables``,
    ``context_lens``, ``query_lens``), or ``rest_rows`` ``None`` when every sequence is fresh."""

    prompts: list[tuple[int, int]]
    rest_rows: torch.Tensor | None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None


def plan_prompts(
    block_tables: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor
) -> PromptPlan | None:
    """The split of one batch (its ``[S, max_blocks]``, ``[S]``, ``[S]`` tensors), or ``None``
    when it has no fresh prompt of at least :data:`MIN_TOKENS` tokens (the paged kernel then
    takes the whole batch)."""
    ctx, ql = context_lens.tolist(), query_lens.tolist()
    prompts: list[tuple[int, int]] = []
    rest: list[int] = []
    rows: list[int] = []
    at = 0
    for s, (c, n) in enumerate(zip(ctx, ql)):
        if c == n >= MIN_TOKENS:
            prompts.append((at, at + n))
        else:
            rest.append(s)
            rows += range(at, at + n)
        at += n
    if not prompts:
        return None
    if not rest:
        return PromptPlan(prompts, None)
    idx = torch.tensor(rest)
    return PromptPlan(prompts, torch.tensor(rows), block_tables[idx], context_lens[idx], query_lens[idx])


PagedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attend(
    plan: PromptPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: PagedFn
) -> torch.Tensor:
    """``[N, H, D]``: the fresh prompts' causal attention over their own ``k, v [N, Hkv, D]``
    rows by SDPA, the other rows by ``paged(q_rows, block_tables, context_lens, query_lens)``
    (the paged kernel over the cache, which already holds this step's K/V)."""
    out = torch.empty_like(q)
    for a, b in plan.prompts:
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None],
            k[a:b].transpose(0, 1)[None],
            v[a:b].transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )
        out[a:b] = o[0].transpose(0, 1)
    if plan.rest_rows is not None:
        assert plan.block_tables is not None and plan.context_lens is not None
        assert plan.query_lens is not None
        out[plan.rest_rows] = paged(q[plan.rest_rows], plan.block_tables, plan.context_lens, plan.query_lens)
    return out
