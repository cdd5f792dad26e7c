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
import torch.nn.functional as F

from llmlab import kernels
from llmlab.inference.paged_attention import paged_attention, slot_mapping, use_triton, write_kv
from llmlab.inference.scheduler import SchedulerOutput
from llmlab.model.llama import MLP, LlamaForCausalLM, apply_rotary, rotary_cos_sin


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers: 2 (K and V) x layers x block_size x kv_heads x D x
    element size."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


_CALL_COST = 32768      # one more attention call, in padded (query, key) pairs; rough CPU figure


def _buckets(group: list[tuple], max_parts: int = 4) -> list[list[tuple]]:
    """Cut ``(seq, num_new_tokens)`` pairs, sorted by context length, into up to ``max_parts``
    contiguous buckets when that saves padding: the reference attention pads each call's queries
    and keys to its longest, costing about ``S * max_context * (max_query + 16)`` (the gathered
    keys count like 16 queries), plus a fixed cost per call (both rough CPU figures, measured on
    the shipped model: large decode batches split, a few prompts do not). Greedy: split the bucket where one cut saves the most, while it saves more
    than a call costs."""
    g = sorted(group, key=lambda x: x[0].num_computed_tokens + x[1])
    ctx = [s.num_computed_tokens + n for s, n in g]              # ascending
    ql = [n for _, n in g]

    def cost(lo, hi, qmax):       # bucket g[lo:hi]: keys gathered (each counted like 16 queries)
        return (hi - lo) * ctx[hi - 1] * (qmax + 16)             # plus (query, key) pairs

    def best_cut(lo, hi):         # (gain, cut) of the best single cut of g[lo:hi], O(hi - lo)
        pre, m = [], 0
        for i in range(lo, hi):
            m = max(m, ql[i])
            pre.append(m)                                        # max query of g[lo:i+1]
        suf, m = [0] * (hi - lo + 1), 0
        for i in range(hi - 1, lo - 1, -1):
            m = max(m, ql[i])
            suf[i - lo] = m                                      # max query of g[i:hi]
        whole = cost(lo, hi, pre[-1])
        best = (0, None)
        for i in range(lo + 1, hi):
            gain = whole - cost(lo, i, pre[i - 1 - lo]) - cost(i, hi, suf[i - lo]) - _CALL_COST
            if gain > best[0]:
                best = (gain, i)
        return best

    bounds = [(0, len(g))]
    while len(bounds) < max_parts:
        cuts = [(best_cut(lo, hi), k) for k, (lo, hi) in enumerate(bounds) if hi - lo > 1]
        cuts = [(gain, cut, k) for (gain, cut), k in cuts if cut is not None]
        if not cuts:
            break
        _, cut, k = max(cuts)
        lo, hi = bounds[k]
        bounds[k:k + 1] = [(lo, cut), (cut, hi)]
    return [g[lo:hi] for lo, hi in bounds]


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
        self._fused = [self._fuse(layer) for layer in self.model.model.layers]
        # RoPE tables for every position once (same elementwise maths as per-step tables)
        self._cos, self._sin = rotary_cos_sin(torch.arange(c.max_position_embeddings, device=device),
                                              c.head_dim, c.rope_theta, dtype)

    @staticmethod
    def _fuse(layer) -> dict:
        """One matmul for q/k/v and one for gate/up where they are plain ``nn.Linear`` layers:
        the separate weights become views of one concatenated tensor (no extra memory), so a
        step runs 2 projections per layer instead of 5 (fewer kernel launches, less overhead)."""
        def cat(mods):
            if not all(type(m) is torch.nn.Linear for m in mods):
                return None                               # e.g. int8 weights: keep the modules
            if len({m.bias is None for m in mods}) != 1:
                return None
            w = torch.cat([m.weight.data for m in mods])
            b = None if mods[0].bias is None else torch.cat([m.bias.data for m in mods])
            r = 0
            for m in mods:
                n = m.weight.shape[0]
                m.weight = torch.nn.Parameter(w[r:r + n], requires_grad=False)
                if b is not None:
                    m.bias = torch.nn.Parameter(b[r:r + n], requires_grad=False)
                r += n
            return (w, b, [m.weight.shape[0] for m in mods])
        attn, mlp = layer.self_attn, layer.mlp
        qkv = cat([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = cat([mlp.gate_proj, mlp.up_proj]) if type(mlp) is MLP else None
        return {"qkv": qkv, "gate_up": gate_up}

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
    def _prepare(self, group: list[tuple], dev) -> dict:
        """Input tensors of one group of ``(seq, num_new_tokens)``: token ids, positions, cache
        slots, padded block tables, context and query lengths."""
        bs = self.block_size
        ids, positions, slots, ctx, qlens, tables = [], [], [], [], [], []
        for seq, n in group:
            c = seq.num_computed_tokens
            table = seq.block_table
            if n == 1:                                   # decode: one token, no ranges
                ids.append(seq.token_ids[c])
                positions.append(c)
                slots.append(table[c // bs] * bs + c % bs)
            else:
                pos = range(c, c + n)
                ids += seq.token_ids[c:c + n]
                positions += pos
                slots += slot_mapping(table, pos, bs)
            ctx.append(c + n)
            qlens.append(n)
            tables.append(table)
        width = max(len(t) for t in tables)
        return {"ids": ids, "positions": positions, "slots": slots,
                "tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev),
                "ctx": torch.tensor(ctx, device=dev), "qlens": torch.tensor(qlens, device=dev)}

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> dict[int, torch.Tensor]:
        """Compute the scheduled tokens, writing their K/V into the cache.

        The step's sequences are attended in two groups, those computing several tokens (prompts,
        prompt chunks, recomputation after preemption) and those decoding one: the reference
        attention pads every query of a call to the longest one, so one decode row next to a
        200-token prompt would otherwise cost 200 padded query rows. Token-wise layers still run
        on all the step's tokens at once. Each row's result is the same maths either way. The
        Triton kernel pads nothing (it walks each sequence's own blocks), so where it runs the whole
        step is one attention call.

        Returns ``{seq_id: logits [vocab] (fp32, CPU)}`` for the sequences whose last token was
        computed in this step (those that sample next); a prompt chunk that stops short gets none.
        """
        dev = self.device
        c = self.config
        if use_triton(torch.empty(0, c.num_attention_heads, c.head_dim, dtype=self.dtype, device=dev),
                      self.kv_cache[0, 0]):
            parts = [list(out.scheduled)]
        else:
            prefill = [(s, n) for s, n in out.scheduled if n > 1]
            decode = [(s, n) for s, n in out.scheduled if n == 1]
            parts = [b for g in (prefill, decode) if g for b in _buckets(g)]
        groups = [self._prepare(g, dev) for g in parts]
        sample_rows, sample_seqs, row = [], [], 0
        for seq, n in (x for g in parts for x in g):
            row += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_seqs.append(seq.seq_id)
        sizes = [len(g["ids"]) for g in groups]
        ids = torch.tensor([t for g in groups for t in g["ids"]], device=dev)
        positions = torch.tensor([t for g in groups for t in g["positions"]], device=dev)
        slots = torch.tensor([t for g in groups for t in g["slots"]], device=dev)

        m, c = self.model, self.config
        N = ids.numel()
        if int(positions.max()) < self._cos.shape[0]:
            cos, sin = self._cos[positions], self._sin[positions]                    # [N, D]
        else:
            cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, self.dtype)
        x = m.embed(ids)                                                            # [N, h]
        for li, layer in enumerate(m.model.layers):
            attn = layer.self_attn
            H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
            fused = self._fused[li]
            hn = layer.input_layernorm(x)
            if fused["qkv"] is not None:
                w, b, split = fused["qkv"]
                q, k, v = F.linear(hn, w, b).split(split, dim=-1)
            else:
                q, k, v = attn.q_proj(hn), attn.k_proj(hn), attn.v_proj(hn)
            # RoPE on q and k at once: apply_rotary wants [B, heads, T, D] with tables [T, D]
            qk = torch.cat([q.view(N, H, D), k.view(N, Hkv, D)], dim=1)
            qk = apply_rotary(qk.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
            q, k = qk[:, :H], qk[:, H:]
            v = v.reshape(N, Hkv, D)
            k_cache, v_cache = self.kv_cache[li, 0], self.kv_cache[li, 1]
            write_kv(k_cache, v_cache, k, v, slots)
            if len(groups) == 1:
                g = groups[0]
                o = paged_attention(q, k_cache, v_cache, g["tables"], g["ctx"], g["qlens"])
            else:
                o = torch.cat([paged_attention(qg, k_cache, v_cache, g["tables"], g["ctx"], g["qlens"])
                               for qg, g in zip(q.split(sizes), groups)])
            x = x + attn.o_proj(o.reshape(N, H * D))
            hn = layer.post_attention_layernorm(x)
            if fused["gate_up"] is not None and not kernels.use_fused("swiglu", hn):
                w, b, split = fused["gate_up"]
                gate, up = F.linear(hn, w, b).split(split, dim=-1)
                x = x + layer.mlp.down_proj(F.silu(gate) * up)
            else:
                x = x + layer.mlp(hn[None])[0]
        if not sample_rows:
            return {}
        logits = m.head(x[torch.tensor(sample_rows, device=dev)]).float().cpu()
        return dict(zip(sample_seqs, logits))
