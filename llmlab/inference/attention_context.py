"""The attention metadata of one engine step, set as the model's forward context.

The model runner flattens the step's new tokens of all sequences into one ``[1, N]`` forward of
the model (:mod:`llmlab.model.context`). Every attention layer of that forward hands its
``q [N, H, D]``, ``k, v [N, Hkv, D]`` to :meth:`PagedAttentionContext.attention`, which writes the
new K/V at their cache slots (:func:`~llmlab.inference.paged_attention.write_kv`) and attends each
sequence's queries to its cached tokens through its block table
(:func:`~llmlab.inference.paged_attention.paged_attention`). Orca's *selective batching* (Yu et
al. 2022 §4.2): token-wise layers see one batch, only attention separates the sequences.

A step's tokens are grouped into one or more :class:`AttentionBatch` es, each one attention call:
the runner's ``prepare_prefill`` and ``prepare_decode`` build them (see
:mod:`llmlab.inference.model_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmlab.inference import prompt_sdpa
from llmlab.kernels import cpu_fused
from llmlab.inference.paged_attention import (
    AttentionPlan,
    kernel_for,
    paged_attention,
    plan_attention,
    write_kv,
)
from llmlab.metrics.profiling import phase


@dataclass
class AttentionBatch:
    """One attention call over ``S`` sequences whose ``N = query_lens.sum()`` new tokens are
    consecutive in the step's flattened batch.

    ``input_ids, positions, slot_mapping [N]`` int64 (the flat cache slot of each new token,
    :func:`~llmlab.inference.paged_attention.slot_mapping`); ``block_tables [S, max_blocks]``
    (padded with block 0); ``context_lens [S]`` cached tokens after the step, new ones included;
    ``query_lens [S]``; ``is_prefill``: some sequence computes more than one token."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


@dataclass
class PagedAttentionContext:
    """The forward context of one step: the paged cache ``kv_cache [layers, 2, num_blocks,
    block_size, Hkv, D]`` and the step's :class:`AttentionBatch` es, in the order of the tokens;
    the engine's kernel choices: ``paged_attention`` (the implementation,
    :func:`~llmlab.inference.paged_attention.kernel_for`) and ``cpu_fused`` (which the model's
    layers read from the context: the C++ operators for CPU tensors)."""

    kv_cache: torch.Tensor
    batches: list[AttentionBatch]
    paged_attention: str = "auto"
    cpu_fused: bool = False
    slot_mapping: torch.Tensor = field(init=False)  # [N]: every batch's slots, in order
    plans: dict[tuple[int, int | None], AttentionPlan] = field(init=False)  # (batch, window) -> plan
    prompt_plans: dict[tuple[int, int | None], prompt_sdpa.PromptPlan | None] = field(init=False)
    kernels: dict[int, str] = field(init=False)  # batch -> kernel_for's choice, made by the first layer

    def __post_init__(self) -> None:
        self.slot_mapping = (
            self.batches[0].slot_mapping
            if len(self.batches) == 1
            else torch.cat([b.slot_mapping for b in self.batches])
        )
        self.plans = {}
        self.prompt_plans = {}
        self.kernels = {}

    def cpu_decode_batch(self) -> AttentionBatch | None:
        """The step's batch where the step is one batch of new tokens (one per sequence) whose
        attention runs the C++ kernel with the C++ cache write (``cpu_fused``): what
        :mod:`llmlab.kernels.cpu_decode_stack` computes the layers of in one call; else ``None``."""
        if len(self.batches) != 1 or self.batches[0].is_prefill or not self.cpu_fused:
            return None
        k_cache = self.kv_cache[0, 0]
        if not k_cache.is_cpu or kernel_for(k_cache, k_cache, self.paged_attention) != "cpu":
            return None
        return self.batches[0]

    def _attend(
        self,
        i: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Batch ``i``'s paged attention; the kernel choice and the reference's per-step plan
        (gather indices, mask) are made by the first layer and reused by the others."""
        b = self.batches[i]
        impl = self.kernels.get(i)
        if impl is None:
            impl = self.kernels[i] = kernel_for(q, k_cache, self.paged_attention)
        plan = None
        if impl == "reference":
            key = (i, sliding_window)
            plan = self.plans.get(key)
            if plan is None:
                plan = self.plans[key] = plan_attention(
                    b.block_tables, b.context_lens, b.query_lens, k_cache.shape[1], sliding_window
                )
        with phase("attention", kind="prefill" if b.is_prefill else "decode", tokens=q.shape[0]):
            return paged_attention(
                q,
                k_cache,
                v_cache,
                b.block_tables,
                b.context_lens,
                b.query_lens,
                sliding_window=sliding_window,
                plan=plan,
                impl=impl,
            )

    def _prompt_plan(
        self, i: int, q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None
    ) -> prompt_sdpa.PromptPlan | None:
        """Batch ``i``'s fresh prompts for SDPA (:mod:`llmlab.inference.prompt_sdpa`: the C++
        kernel's 16-bit CPU steps with AMX, without a sliding window), or ``None``; decided and
        planned once per step and window by the first layer, reused by the others."""
        key = (i, sliding_window)
        if key not in self.prompt_plans:
            b = self.batches[i]
            eligible = (
                sliding_window is None
                and b.is_prefill
                and prompt_sdpa.takes(q.dtype)
                and kernel_for(q, k_cache, self.paged_attention) == "cpu"
            )
            self.prompt_plans[key] = (
                prompt_sdpa.plan_prompts(b.block_tables, b.context_lens, b.query_lens) if eligible else None
            )
        return self.prompt_plans[key]

    def _attend_batch(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sliding_window: int | None,
    ) -> torch.Tensor:
        plan = self._prompt_plan(i, q, k_cache, sliding_window)
        if plan is None:
            return self._attend(i, q, k_cache, v_cache, sliding_window)
        with phase("attention", kind="prefill", tokens=q.shape[0]):  # (plans are prefill batches')
            return prompt_sdpa.attend(
                plan,
                q,
                k,
                v,
                lambda qr, bt, cl, ql: paged_attention(
                    qr, k_cache, v_cache, bt, cl, ql, impl=self.paged_attention
                ),
            )

    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write ``k, v [N, Hkv, D]`` into layer ``layer_idx``'s cache, then return the causal
        paged attention of ``q [N, H, D]`` (``[N, H, D]``); with ``sliding_window`` a query sees
        only the last ``sliding_window`` positions, itself included."""
        k_cache, v_cache = self.kv_cache[layer_idx, 0], self.kv_cache[layer_idx, 1]
        if self.cpu_fused and k.is_cpu and k.dtype == k_cache.dtype and _rows(k) and _rows(v):
            cpu_fused.write_kv(k_cache, v_cache, k, v, self.slot_mapping)  # one C++ call
        else:
            write_kv(k_cache, v_cache, k, v, self.slot_mapping)
        if len(self.batches) == 1:
            return self._attend_batch(0, q, k, v, k_cache, v_cache, sliding_window)
        sizes = [b.num_tokens for b in self.batches]
        return torch.cat(
            [
                self._attend_batch(i, qb, kb, vb, k_cache, v_cache, sliding_window)
                for i, (qb, kb, vb) in enumerate(zip(q.split(sizes), k.split(sizes), v.split(sizes)))
            ]
        )


def _rows(t: torch.Tensor) -> bool:
    """Whether each row of ``t [N, heads, D]`` is contiguous (what the C++ cache write reads)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]
