"""Runs one scheduled step through the model, with K/V read and written through block tables.

The weights and layers are those of :class:`llmlab.model.llama.LlamaForCausalLM` (its norms,
projections, rotary tables and MLPs are called directly); only the attention is replaced by
:func:`~llmlab.inference.paged_attention.paged_attention`. The step's tokens of all sequences are
flattened into one ``[N, hidden]`` batch: token-wise operations run on it at once and attention
separates the sequences through the block tables (Orca's *selective batching*, Yu et al. 2022 §4.2).

Cache layout: ``kv_cache [layers, 2, num_blocks, block_size, kv_heads, head_dim]``; a host copy of
the same layout serves swap preemption.
"""
from __future__ import annotations

import torch

from llmlab.inference.paged_attention import paged_attention, slot_mapping, write_kv
from llmlab.inference.scheduler import SchedulerOutput
from llmlab.model.llama import LlamaForCausalLM, apply_rotary, rotary_cos_sin


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers: 2 (K and V) x layers x block_size x kv_heads x D x
    element size."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


class ModelRunner:
    """Owns the model on ``device`` and the paged KV cache (and its host mirror for swapping)."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, num_host_blocks: int = 0):
        self.model = model.to(device=device, dtype=dtype).eval()
        self.config = model.config
        self.device, self.dtype, self.block_size = device, dtype, block_size
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

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            dev, host = zip(*pairs)
            self.host_cache[:, :, list(host)] = self.kv_cache[:, :, list(dev)].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            host, dev = zip(*pairs)
            self.kv_cache[:, :, list(dev)] = self.host_cache[:, :, list(host)].to(self.device)

    # --- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> dict[int, torch.Tensor]:
        """Compute the scheduled tokens, writing their K/V into the cache.

        Returns ``{seq_id: logits [vocab] (fp32, CPU)}`` for the sequences whose last token was
        computed in this step (those that sample next); a prompt chunk that stops short gets none.
        """
        bs, dev = self.block_size, self.device
        ids, positions, slots, ctx, qlens, tables, sample_rows, sample_seqs = [], [], [], [], [], [], [], []
        for seq, n in out.scheduled:
            c = seq.num_computed_tokens
            pos = range(c, c + n)
            ids += seq.token_ids[c:c + n]
            positions += pos
            slots += slot_mapping(seq.block_table, pos, bs)
            ctx.append(c + n)
            qlens.append(n)
            tables.append(seq.block_table)
            if c + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq.seq_id)
        width = max(len(t) for t in tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev)
        ids = torch.tensor(ids, device=dev)
        positions = torch.tensor(positions, device=dev)
        slots = torch.tensor(slots, device=dev)
        ctx = torch.tensor(ctx, device=dev)
        qlens = torch.tensor(qlens, device=dev)

        m, c = self.model, self.config
        N = ids.numel()
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, self.dtype)    # [N, D]
        x = m.embed(ids)                                                            # [N, h]
        for li, layer in enumerate(m.model.layers):
            attn = layer.self_attn
            hn = layer.input_layernorm(x)
            q = attn.q_proj(hn).view(N, attn.num_heads, attn.head_dim)
            k = attn.k_proj(hn).view(N, attn.num_kv_heads, attn.head_dim)
            v = attn.v_proj(hn).view(N, attn.num_kv_heads, attn.head_dim)
            # apply_rotary wants [B, H, T, D] with tables [T, D]
            q = apply_rotary(q.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
            k = apply_rotary(k.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
            k_cache, v_cache = self.kv_cache[li, 0], self.kv_cache[li, 1]
            write_kv(k_cache, v_cache, k, v, slots)
            o = paged_attention(q, k_cache, v_cache, tables, ctx, qlens)
            x = x + attn.o_proj(o.reshape(N, attn.num_heads * attn.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x)[None])[0]
        if not sample_rows:
            return {}
        logits = m.head(x[torch.tensor(sample_rows, device=dev)]).float().cpu()
        return dict(zip(sample_seqs, logits))
