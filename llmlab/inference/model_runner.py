"""Runs one scheduled step through the model's own forward, K/V read and written through block
tables.

The step's new tokens of all sequences are flattened into one ``[1, N]`` batch and run through
:class:`llmlab.model.llama.LlamaForCausalLM` itself (its embedding, decoder layers and head), with
the step's attention metadata set as the forward context
(:class:`~llmlab.inference.attention_context.PagedAttentionContext`, as nano-vllm does): each
attention layer writes its new K/V at their cache slots and attends through the block tables
(:mod:`llmlab.inference.paged_attention`). Token-wise layers see one batch; attention separates the
sequences (Orca's *selective batching*, Yu et al. 2022 §4.2).

:meth:`ModelRunner.prepare_prefill` and :meth:`ModelRunner.prepare_decode` turn scheduled
``(sequence, num_new_tokens)`` pairs into an
:class:`~llmlab.inference.attention_context.AttentionBatch` (token ids, positions, slot mapping,
block tables, context and query lengths). Where the Triton kernel runs, a step is one batch; the
padding PyTorch reference attends prompts and decodes in separate calls, optionally cut further
by length (:mod:`llmlab.inference.padding_buckets`).

Cache layout: ``kv_cache [layers, 2, num_blocks, block_size, kv_heads, head_dim]``; a host copy of
the same layout serves swap preemption.
"""

from __future__ import annotations

from typing import Any

import torch

from llmlab.inference.attention_context import AttentionBatch, PagedAttentionContext
from llmlab.inference.greedy_screen import GreedyScreen
from llmlab.inference.padding_buckets import buckets
from llmlab.inference.paged_attention import slot_mapping, walks_block_tables
from llmlab.inference.scheduler import SchedulerOutput
from llmlab.metrics.profiling import phase
from llmlab.inference.sequence import Sequence
from llmlab.kernels import cpu_isa
from llmlab.model.context import forward_context
from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers: 2 (K and V) x layers x block_size x kv_heads x D x
    element size."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


class ModelRunner:
    """Owns the model on ``device`` and the paged KV cache (and its host mirror for swapping).

    ``padding_buckets``: where the padding reference attention runs, cut prompt and decode groups
    into length buckets when that saves padding (:func:`~llmlab.inference.padding_buckets.buckets`;
    the same maths either way). The kernel choices, as the engine's
    :class:`~llmlab.inference.engine_config.EngineConfig` fields of the same names:
    ``paged_attention`` (:func:`~llmlab.inference.paged_attention.kernel_for`), ``packed_linear``
    (on a CPU device the linear weights are packed once, :mod:`llmlab.kernels.cpu_linear`) and
    ``cpu_fused`` (the step's forward context tells the model to use the C++ operators)."""

    lora: Any = None  # LoRASlots after LLMEngine.enable_lora (llmlab.inference.lora); subclasses too

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        num_host_blocks: int = 0,
        padding_buckets: bool = True,
        paged_attention: str = "auto",
        packed_linear: bool = False,
        cpu_fused: bool = False,
    ):
        self.model = model.to(device=device, dtype=dtype).eval().fuse_projections()
        self.paged_attention, self.cpu_fused = paged_attention, cpu_fused
        if packed_linear and device.type == "cpu":
            from llmlab.kernels.cpu_linear import pack_linears

            pack_linears(self.model)  # oneDNN-blocked weights, once (llmlab.kernels.cpu_linear)
            head = getattr(self.model, "lm_head", None)
            if cpu_fused and head is not None and GreedyScreen.applies(head.weight):
                self.greedy_screen = GreedyScreen(head.weight)  # fp32 greedy rows: bf16-screened
        self.config = model.config
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.padding_buckets = padding_buckets
        c = self.config
        shape = (c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, device=device, dtype=dtype)
        host_shape = shape[:2] + (num_host_blocks,) + shape[3:]
        pin = device.type == "cuda"
        self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin) if num_host_blocks else None

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    # --- block copies -----------------------------------------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block ``src`` -> device block ``dst`` for every layer, K and V."""
        if pairs:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*pairs))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _host(self) -> torch.Tensor:
        if self.host_cache is None:
            raise RuntimeError("swap preemption needs host blocks: this runner has num_host_blocks=0")
        return self.host_cache

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            dev, host = zip(*pairs)
            self._host()[:, :, list(host)] = self.kv_cache[:, :, list(dev)].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            host, dev = zip(*pairs)
            self.kv_cache[:, :, list(dev)] = self._host()[:, :, list(host)].to(self.device)

    # --- the step ---------------------------------------------------------------------------------
    def _batch(self, group: list[tuple[Sequence, int]], is_prefill: bool) -> AttentionBatch:
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        ctx: list[int] = []
        qlens: list[int] = []
        tables: list[list[int]] = []
        for seq, n in group:
            c = seq.num_computed_tokens
            pos = range(c, c + n)
            ids += seq.token_ids[c : c + n]
            positions += pos
            slots += slot_mapping(seq.block_table, pos, bs)
            ctx.append(c + n)
            qlens.append(n)
            tables.append(seq.block_table)
        width = max(len(t) for t in tables)
        return AttentionBatch(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev),
            context_lens=torch.tensor(ctx, device=dev),
            query_lens=torch.tensor(qlens, device=dev),
            is_prefill=is_prefill,
        )

    def prepare_prefill(self, group: list[tuple[Sequence, int]]) -> AttentionBatch:
        """The batch of ``(seq, n)`` pairs computing ``n`` tokens each from their
        ``num_computed_tokens`` on: prompts, prompt chunks, recomputation after preemption (decode
        rows, ``n = 1``, may share it)."""
        return self._batch(group, is_prefill=any(n > 1 for _, n in group))

    def prepare_decode(self, group: list[tuple[Sequence, int]]) -> AttentionBatch:
        """The batch of ``(seq, 1)`` pairs: each computes its newest token."""
        if any(n != 1 for _, n in group):
            raise ValueError("prepare_decode takes sequences computing exactly one token")
        return self._batch(group, is_prefill=False)

    def attention_groups(self, scheduled: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
        """The step's ``(seq, n)`` pairs grouped into attention calls: all in one where a
        kernel runs (Triton or the CPU one: it walks each sequence's own blocks, no padding); otherwise prompts
        apart from decodes (the reference pads every query of a call to the longest, so one
        decode row next to a 200-token prompt would cost 200 rows), each optionally cut into
        length buckets."""
        c = self.config
        probe = torch.empty(0, c.num_attention_heads, c.head_dim, dtype=self.dtype, device=self.device)
        if walks_block_tables(probe, self.kv_cache[0, 0], self.paged_attention):
            return [list(scheduled)]
        groups = [g for g in ([x for x in scheduled if x[1] > 1], [x for x in scheduled if x[1] == 1]) if g]
        if self.padding_buckets:
            groups = [b for g in groups for b in buckets(g)]
        return groups

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> dict[int, torch.Tensor]:
        """Compute the scheduled tokens with the model's forward, writing their K/V into the cache.

        Returns ``{seq_id: logits [vocab] (fp32, CPU)}`` for the sequences whose last token was
        computed in this step (those that sample next); a prompt chunk that stops short gets none.
        """
        return self.execute_with_prompt_logits(out, frozenset())[0]

    @torch.no_grad()
    def execute_with_prompt_logits(
        self, out: SchedulerOutput, seq_ids: frozenset[int]
    ) -> tuple[dict[int, torch.Tensor], dict[int, tuple[int, torch.Tensor]]]:
        """:meth:`execute`, and in the same forward the logits of every position this step
        computes that predicts a prompt token, for the sequences in ``seq_ids`` (vLLM's
        ``prompt_logprobs``, gathered in the batched step): ``{seq_id: (first position,
        logits [m, vocab] fp32 CPU)}``, row ``j`` predicting prompt token ``first + j + 1``."""
        logits, prompt, _ = self.execute_greedy(out, seq_ids, frozenset())
        return logits, prompt

    # The fp32 lm_head's greedy screen (llmlab.inference.greedy_screen), where it applies.
    greedy_screen: GreedyScreen | None = None

    @torch.no_grad()
    def execute_greedy(
        self, out: SchedulerOutput, seq_ids: frozenset[int], greedy: frozenset[int]
    ) -> tuple[dict[int, torch.Tensor], dict[int, tuple[int, torch.Tensor]], dict[int, int]]:
        """:meth:`execute_with_prompt_logits`, and ``{seq_id: token}`` for the sequences of
        ``greedy`` (plain greedy: :func:`~llmlab.inference.batched_greedy.is_plain_greedy`) whose
        token the :attr:`greedy_screen` found; those have no logits row. Without a screen, or
        for a row it could not settle (not finite), the logits as :meth:`execute`'s."""
        batches, sample_rows, sample_seqs = self.prepare(out)
        prompt_rows = self.prompt_rows(out, seq_ids)
        extra = [r for _, _, rows in prompt_rows for r in rows]
        order, mm_inputs = self._multimodal_inputs(out)
        screen = self.greedy_screen if any(s in greedy for s in sample_seqs) else None
        kinds = sorted({"prefill" if b.is_prefill else "decode" for b in batches})
        with phase("+".join(kinds), tokens=sum(b.num_tokens for b in batches)):
            # always: it writes the K/V
            if screen is None:
                logits = self.forward(batches, sample_rows + extra, **mm_inputs)
            else:
                logits = self._forward(batches, sample_rows + extra, True, **mm_inputs)
        if mm_inputs:
            from llmlab.inference import multimodal

            multimodal.release_done(order)
        if not sample_rows and not extra:
            return {}, {}, {}
        tokens: dict[int, int] = {}
        if screen is not None:
            logits, tokens = self._screen(screen, logits, sample_seqs, greedy)
        logits = logits.float().cpu()
        kept = [s for s in sample_seqs if s not in tokens]  # (the screened rows have no logits)
        sampled = dict(zip(kept, logits[: len(kept)]))
        prompt: dict[int, tuple[int, torch.Tensor]] = {}
        at = len(kept)
        for sid, first, rows in prompt_rows:
            prompt[sid] = (first, logits[at : at + len(rows)])
            at += len(rows)
        return sampled, prompt, tokens

    def _screen(
        self, screen: GreedyScreen, hidden: torch.Tensor, sample_seqs: list[int], greedy: frozenset[int]
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """The screened tokens of the plain-greedy sample rows of ``hidden [rows, h]`` (the final
        norm's output; sample rows first) and the logits of the other rows, in order."""
        pick = [i for i, s in enumerate(sample_seqs) if s in greedy]
        found = screen.argmax(hidden[pick])
        tokens: dict[int, int] = {}
        if found is not None:
            tokens = {sample_seqs[i]: t for i, t, ok in zip(pick, *found) if ok}
        rest = [i for i in range(hidden.shape[0]) if i >= len(sample_seqs) or sample_seqs[i] not in tokens]
        return self.model.lm_head(hidden[rest]), tokens

    def _multimodal_inputs(
        self, out: SchedulerOutput
    ) -> tuple[list[tuple[Sequence, int]], dict[str, torch.Tensor]]:
        """A vision-language model's extra forward inputs (M-RoPE ids, image-token embeddings;
        :func:`llmlab.inference.multimodal.step_inputs`) and the step's ``(seq, n)`` order;
        ``([], {})`` for a text model."""
        if not getattr(self.model, "is_multimodal", False):
            return [], {}
        from llmlab.inference import multimodal

        order = [x for g in self.attention_groups(out.scheduled) for x in g]
        return order, multimodal.step_inputs(self.model, order, self.device)

    # --- LoRA adapters (llmlab.inference.lora; LLMEngine.enable_lora/add_lora/remove_lora) ---------
    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        """Give the model's target layers ``max_loras`` adapter slots (:func:`~llmlab.inference.
        lora.enable_lora`); ``ValueError`` for a bound below 1."""
        from llmlab.inference.lora import enable_lora

        self.lora = enable_lora(self.model, max_loras, max_lora_rank)

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter into a free slot (:meth:`~llmlab.inference.lora.LoRASlots.load`)."""
        self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Free adapter ``name``'s slot; ``KeyError`` when none is loaded by that name."""
        self.lora.unload(name)

    def prepare(self, out: SchedulerOutput) -> tuple[list[AttentionBatch], list[int], list[int]]:
        """The step's attention batches, the rows of the flattened step whose logits are sampled
        (each sequence's last token, when it is its last to compute) and their sequence ids."""
        groups = self.attention_groups(out.scheduled)
        if self.lora is not None:  # each token's adapter slot (llmlab.inference.lora)
            self.lora.set_tokens([(seq.lora_id, n) for g in groups for seq, n in g], self.device)
        batches = [
            self.prepare_decode(g) if all(n == 1 for _, n in g) else self.prepare_prefill(g) for g in groups
        ]
        sample_rows, sample_seqs, row = [], [], 0
        for seq, n in (x for g in groups for x in g):
            row += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_seqs.append(seq.seq_id)
        return batches, sample_rows, sample_seqs

    def prompt_rows(self, out: SchedulerOutput, seq_ids: frozenset[int]) -> list[tuple[int, int, list[int]]]:
        """``(seq_id, first position, rows)``: the rows of the flattened step (in
        :meth:`prepare`'s order) at positions ``< num_prompt_tokens - 1`` of the sequences in
        ``seq_ids`` (the positions whose next token is a prompt token)."""
        found: list[tuple[int, int, list[int]]] = []
        if not seq_ids:
            return found
        row = 0
        for seq, n in (x for g in self.attention_groups(out.scheduled) for x in g):
            c = seq.num_computed_tokens
            stop = min(c + n, seq.num_prompt_tokens - 1)
            if seq.seq_id in seq_ids and stop > c:
                found.append((seq.seq_id, c, list(range(row, row + stop - c))))
            row += n
        return found

    @torch.no_grad()
    def forward(
        self, batches: list[AttentionBatch], sample_rows: list[int], **extra: torch.Tensor
    ) -> torch.Tensor:
        """The model's own forward over the step's tokens ``[1, N]`` with the paged-attention
        context set; returns the logits of ``sample_rows`` ``[len(sample_rows), vocab]``.
        ``extra``: a multimodal model's ``positions [3, N]`` (replacing the batches'),
        ``image_embeds`` and ``image_mask`` (:func:`llmlab.inference.multimodal.step_inputs`)."""
        return self._forward(batches, sample_rows, False, **extra)

    def _forward(
        self,
        batches: list[AttentionBatch],
        sample_rows: list[int],
        return_hidden: bool,
        **extra: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward`; with ``return_hidden`` the rows' final hidden states ``[len(sample_rows),
        hidden]`` (after the final norm) instead of their logits."""
        if len(batches) == 1:
            ids, positions = batches[0].input_ids, batches[0].positions
        else:
            ids = torch.cat([b.input_ids for b in batches])
            positions = torch.cat([b.positions for b in batches])
        rows = torch.tensor(sample_rows, device=self.device, dtype=torch.long)
        positions = extra.pop("positions", positions)
        with (
            cpu_isa.pinned(),  # one level for all the step's kernel choices
            forward_context(
                PagedAttentionContext(self.kv_cache, batches, self.paged_attention, self.cpu_fused)
            ),
        ):
            logits: torch.Tensor = self.model(
                ids[None], positions=positions, logits_indices=rows, return_hidden=return_hidden, **extra
            )
        return logits
