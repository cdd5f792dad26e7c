"""The single-device reference model: a Llama-family decoder.

RMSNorm, rotary position embeddings (RoPE), SwiGLU MLP and grouped-query attention (GQA), as in
Llama 2/3 (Touvron et al. 2023) and Qwen2. Parameter names are those of Hugging Face's
``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.weight`` ...), so a local HF checkpoint
loads with ``load_state_dict`` (see :mod:`llmlab.model.hf`).

Every parallel strategy in :mod:`llmlab.parallel` starts from this model, built in full on every
rank from the same seed (:func:`init_weights`), and then shards it. The initialisation therefore
depends only on the seed, never on the layout.

Shapes: ``B`` batch, ``T`` sequence length, ``h`` hidden size, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmlab import kernels
from llmlab.kernels import cpu_decode_stack, cpu_fused
from llmlab.kernels.cpu_linear import PackedLinear, panels_for, swiglu_panels_for
from llmlab.model.config import ModelConfig
from llmlab.model.context import engine_cpu_fused, get_context
from llmlab.model.layers import MLP, RMSNorm, concat_linears
from llmlab.model.moe import MoE


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """RoPE frequencies ``theta^(-2i/D)``, ``[D/2]`` fp32, with Hugging Face's scalings:
    ``{"rope_type": "linear", "factor": f}`` divides every frequency by ``f`` (position
    interpolation, Chen et al. 2023); ``"llama3"`` (Llama 3.1) divides only the low frequencies
    (wavelength above ``original_max_position_embeddings / low_freq_factor``) by ``factor``, keeps
    the high ones (below ``... / high_freq_factor``) and blends linearly in between. Raises
    ``ValueError`` for another ``rope_type``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    scaling = scaling or {}
    rt = scaling.get("rope_type", "default")
    if rt == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if rt == "linear":
        return inv_freq / factor
    if rt == "llama3":
        old_len = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling rope_type={rt!r} is not supported (default, linear, llama3)")


def rotary_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype = torch.float32,
    scaling: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for RoPE (Su et al. 2021), shape ``positions.shape + (head_dim,)``;
    ``scaling``: see :func:`rope_inv_freq`."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, H, T, D]`` by tables of shape ``[T, D]`` or ``[B, T, D]``."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def causal_attention(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention core of ``module``: ``q [B,H,T,D]``, ``k, v [B,H_kv,T,D]`` -> ``[B,H,T,D]``.

    ``module.core_attention``, when set, replaces it (context parallelism installs ring or
    Ulysses attention there, :mod:`llmlab.parallel.context_parallel`); otherwise K/V heads are
    repeated for GQA and the opt-in fused kernel or PyTorch's SDPA runs. A layer with
    ``module.sliding_window = W`` lets query ``i`` see keys ``i - W < j <= i`` only.
    """
    core = getattr(module, "core_attention", None)
    window = getattr(module, "sliding_window", None)
    if core is not None:
        if window is not None:
            raise NotImplementedError("context parallelism does not support sliding-window layers")
        return core(q, k, v)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if window is not None:
        i = torch.arange(q.shape[2], device=q.device)
        d = i[:, None] - i[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(d >= 0) & (d < window))
    if kernels.use_fused("attention", q):  # opt-in flash attention (llmlab.kernels)
        return kernels.attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal grouped-query self-attention. ``forward(x [B,T,h], cos, sin) -> [B,T,h]``.

    ``num_heads``/``num_kv_heads`` are the heads this module holds: all of them on one device,
    ``1/tp`` of them under tensor parallelism (the TP wrapper updates them). Inside a serving
    engine's :func:`~llmlab.model.context.forward_context` the attention itself is the context's
    (paged K/V, many sequences in one flattened batch); the projections and RoPE are these.
    """

    core_attention = None  # context parallelism sets a callable (q, k, v) -> out

    def __init__(self, config: ModelConfig, layer_idx: int = 0):
        super().__init__()
        h, D = config.hidden_size, config.head_dim
        self.head_dim = D
        self.layer_idx = layer_idx
        slides = layer_idx in config.sliding_window_layers
        self.sliding_window = config.sliding_window if slides else None  # keys per query
        self.fused_qkv = None  # (weight, bias, split) after fuse(): one q/k/v matmul
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(h, self.num_heads * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, h, bias=config.o_proj_bias)

    def fuse(self) -> None:
        """q/k/v as one matmul over views of one weight (inference; see :func:`concat_linears`)."""
        self.fused_qkv = concat_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused_qkv is not None:
            w, b, split = self.fused_qkv
            q, k, v = kernels.linear(x, w, b).split_with_sizes(split, -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        ctx = get_context()
        if ctx is not None:  # serving: the engine's attention over its paged cache
            return self._serve(ctx, q, k, v, cos, sin)
        q = q.view(B, T, H, D).transpose(1, 2)
        k = k.view(B, T, Hkv, D).transpose(1, 2)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = causal_attention(self, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def _serve(self, ctx, q, k, v, cos, sin) -> torch.Tensor:
        """The serving path, token-major: ``q [B,T,H*D]``, ``k, v [B,T,Hkv*D]`` (views of the
        fused projection's output) are rotated in layout ``[B*T, heads, D]`` (no transposes, q
        and k in one pass, :func:`llmlab.kernels.rotary`; the same arithmetic as
        :func:`apply_rotary`) and handed to the engine's ``ctx.attention``; returns ``[B,T,h]``."""
        B, T, _ = q.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        N = B * T
        fused = (
            q.data_ptr() + H * D * q.element_size() == k.data_ptr()
            and q.stride(-2) == k.stride(-2)
            and (B == 1 or q.stride(0) == T * q.stride(1))
        )
        if fused:
            qk = q.as_strided((N, H + Hkv, D), (q.stride(-2), D, 1))  # q|k of the fused output
        else:
            qk = torch.cat([q.reshape(N, H, D), k.reshape(N, Hkv, D)], dim=1)
        qk = kernels.rotary(qk, cos.reshape(N, D), sin.reshape(N, D), getattr(ctx, "cpu_fused", None))
        o = ctx.attention(self.layer_idx, qk[:, :H], qk[:, H:], v.reshape(N, Hkv, D), self.sliding_window)
        return self.o_proj(o.reshape(B, T, H * D))


def make_mlp(config: ModelConfig) -> nn.Module:
    """The MLP slot of a decoder layer: dense SwiGLU, or a mixture of experts."""
    if config.num_experts:
        return MoE(config)
    return MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx is not None and getattr(ctx, "cpu_fused", False) and x.is_cpu and self._fused_serving():
            return self._serve_cpu(ctx, x, cos, sin)
        h = self.self_attn(self.input_layernorm(x), cos, sin)
        if kernels.use_fused("residual_rmsnorm", h, engine_cpu_fused()):  # add + norm, one pass (CPU)
            h, x = self.post_attention_layernorm(h, residual=x)
        else:
            x = x + h
            h = self.post_attention_layernorm(x)
        return x + self.mlp(h)

    def _fused_serving(self) -> bool:
        """Whether :meth:`_serve_cpu` takes this layer: this model's attention, RMSNorm and dense
        MLP, with q/k/v and gate/up fused (the engine fuses them; LoRA and tensor parallelism keep
        them apart)."""
        a, mlp = self.self_attn, self.mlp
        return (
            type(a) is Attention
            and a.fused_qkv is not None
            and type(mlp) is MLP
            and mlp.fused_gate_up is not None
            and type(self.input_layernorm) is RMSNorm
            and type(self.post_attention_layernorm) is RMSNorm
        )

    def _serve_cpu(self, ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The serving forward of ``x [B,T,h]`` with the engine's C++ CPU operators on
        (``ctx.cpu_fused``): the operators :meth:`forward`'s modules call there, in the same
        order on the same tensors (RMSNorm, the fused q/k/v product, then :meth:`Attention._serve`
        for RoPE, ``ctx.attention`` and ``o_proj``, the residual add with RMSNorm, the fused
        gate/up product and SwiGLU, ``down_proj``, the residual add), called straight, without
        the modules' dispatch (which kernel, which layout: a few dozen Python calls a layer; a
        decode layer of a 30-layer model of width 128 went from about 127 to 116 us at one
        sequence, 457 to 445 us at 64: docs/kernels.md, "Session 17"). Same outputs, bit for bit. (Forward hooks on the
        submodules it calls straight, the norms and the attention and MLP modules, do not run
        here.)"""
        a: Any = self.self_attn  # (an Attention and an MLP: _fused_serving)
        mlp: Any = self.mlp
        B, T, hidden = x.shape
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        xf = x.reshape(B * T, hidden)
        w, b, split = a.fused_qkv
        q, k, v = kernels.linear(cpu_fused.rms_norm(x, n1.weight, n1.eps), w, b).split_with_sizes(split, -1)
        o = a._serve(ctx, q, k, v, cos, sin).reshape(B * T, hidden)  # RoPE, ctx.attention, o_proj
        h, xf = cpu_fused.rms_norm(o, n2.weight, n2.eps, xf)
        w, b, split = mlp.fused_gate_up
        act = kernels.gate_up_swiglu(h, w, b)
        if act is None:
            gate, up = kernels.linear(h, w, b).split_with_sizes(split, -1)
            act = cpu_fused.silu_mul(gate, up)
        return (xf + _linear(mlp.down_proj, act)).view(B, T, hidden)

    def _stack_weights(self, rows: int, heads: tuple[int, int, int]) -> cpu_decode_stack.LayerWeights | None:
        """This layer's part of the C++ decode stack (:mod:`llmlab.kernels.cpu_decode_stack`) for a
        step of ``rows`` tokens with ``heads = (H, Hkv, D)``: where :meth:`_serve_cpu` takes the
        layer, it has those heads, and each of its four products would run on panels, the same
        weights; else ``None``."""
        if not self._fused_serving():
            return None
        a: Any = self.self_attn
        mlp: Any = self.mlp
        (wq, bq, split), (wg, bg, _) = a.fused_qkv, mlp.fused_gate_up
        o, down = a.o_proj, mlp.down_proj
        H, Hkv, D = heads
        if (
            (a.num_heads, a.num_kv_heads, a.head_dim) != heads
            or type(o) is not PackedLinear
            or type(down) is not PackedLinear
            or list(split) != [H * D, Hkv * D, Hkv * D]
        ):
            return None
        swiglu = swiglu_panels_for(wg, bg)
        qkv, po, pd = panels_for(wq, rows), panels_for(o.weight, rows), panels_for(down.weight, rows)
        gu = swiglu if swiglu is not None else panels_for(wg, rows)
        if qkv is None or po is None or pd is None or gu is None:
            return None
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        window = -1 if a.sliding_window is None else int(a.sliding_window)
        return cpu_decode_stack.LayerWeights(
            self.layer_idx,
            n1.weight,
            n1.eps,
            qkv,
            bq,
            po,
            o.bias,
            n2.weight,
            n2.eps,
            gu,
            bg,
            swiglu is not None,
            pd,
            down.bias,
            wg.shape[0] // 2,
            window,
        )


def _linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)``; for an ``nn.Linear`` or the engine's packed one, what their forward calls
    (``F.linear``, :func:`llmlab.kernels.linear`) without the module call."""
    if type(m) is PackedLinear:
        return kernels.linear(x, m.weight, m.bias)
    if type(m) is nn.Linear:
        return F.linear(x, m.weight, m.bias)
    return m(x)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``LlamaModel``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only language model.

    ``forward(input_ids [B,T] int64, labels [B,T] | None)`` returns logits ``[B,T,vocab]`` when
    ``labels`` is None, else the scalar training loss: mean next-token cross-entropy over labels
    that are not ``-100`` plus any auxiliary losses the layers report (MoE load balancing).
    The pieces ``embed``/``run_layers``/``head``/``compute_loss`` are public so that pipeline
    stages can run a slice of the model.

    Raises ``ValueError`` if the config is inconsistent (see :meth:`ModelConfig.validate`).
    """

    def __init__(self, config: ModelConfig, seed: int | None = 0):
        super().__init__()
        self.config = config.validate()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if seed is not None:
            init_weights(self, seed)

    # --- pieces ---------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    # Context parallelism sets the positions of this rank's tokens (int64 [T]); None = 0..T-1.
    position_ids: torch.Tensor | None = None

    def rotary(self, T: int, device, dtype, offset: int = 0):
        if self.position_ids is not None:
            if self.position_ids.numel() != T:
                raise ValueError(
                    f"{T} tokens but {self.position_ids.numel()} position_ids "
                    f"(context parallelism: each rank holds seq_len/cp tokens)"
                )
            pos = self.position_ids.to(device) + offset
        else:
            pos = torch.arange(offset, offset + T, device=device)
        return self.rotary_at(pos, dtype)

    def rotary_at(self, positions: torch.Tensor, dtype):
        """cos, sin ``positions.shape + (head_dim,)`` with this model's RoPE (and scaling)."""
        c = self.config
        return rotary_cos_sin(positions, c.head_dim, c.rope_theta, dtype, c.rope_scaling)

    def run_layers(
        self,
        hidden: torch.Tensor,
        layers=None,
        seq_len: int | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Apply ``layers`` (default: all) to ``hidden [B,T,h]``. ``seq_len`` overrides T for RoPE
        when the hidden state is sharded along the sequence; ``positions [T]`` gives each token's
        position instead of ``0..T-1`` (a serving step: the new tokens of many sequences)."""
        if positions is not None:
            cos, sin = self.rotary_at(positions, hidden.dtype)
        else:
            T = seq_len if seq_len is not None else hidden.shape[1] * self.sequence_shards
            cos, sin = self.rotary(T, hidden.device, hidden.dtype)
        layers = self.model.layers if layers is None else layers
        stacked = self._decode_stack(hidden, cos, sin, layers)
        if stacked is not None:
            return stacked
        for layer in layers:
            hidden = layer(hidden, cos, sin)
        return hidden

    def _decode_stack(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers
    ) -> torch.Tensor | None:
        """A serving decode step's ``layers`` in one C++ call (:mod:`llmlab.kernels.cpu_decode_stack`)
        where the engine's C++ operators are on and every layer would call them anyway
        (:meth:`DecoderLayer._stack_weights`); ``None`` otherwise (the layers run one by one)."""
        ctx = get_context()
        if ctx is None or not getattr(ctx, "cpu_fused", False) or not hidden.is_cpu:
            return None
        batch = ctx.cpu_decode_batch() if hasattr(ctx, "cpu_decode_batch") else None
        if batch is None or hidden.dtype != ctx.kv_cache.dtype or not len(layers):
            return None
        if type(layers[0]) is not DecoderLayer:
            return None
        B, T, h = hidden.shape
        a = layers[0].self_attn
        heads = (a.num_heads, a.num_kv_heads, a.head_dim)
        weights = []
        for layer in layers:
            w = layer._stack_weights(B * T, heads) if type(layer) is DecoderLayer else None
            if w is None:
                return None
            weights.append(w)
        D = a.head_dim
        out = cpu_decode_stack.decode_layers(
            hidden.reshape(B * T, h),
            cos.reshape(B * T, D),
            sin.reshape(B * T, D),
            ctx.kv_cache,
            batch,
            ctx.slot_mapping,
            weights,
            heads,
        )
        return out.view(B, T, h)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    # Tensor parallelism sets these (llmlab.parallel.tp_plan.apply_tensor_parallel):
    # the hidden state is split into ``sequence_shards`` along the sequence (sequence parallelism),
    # and ``loss_function(logits, labels)`` computes the loss from vocabulary-sharded logits.
    sequence_shards: int = 1
    loss_function = None

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over labels ``!= -100`` (0, not nan, if every label is
        ignored: a micro-batch of padding only adds nothing)."""
        if self.loss_function is not None:
            return self.loss_function(logits, labels)
        labels = labels.flatten()
        total = F.cross_entropy(logits.float().flatten(0, -2), labels, ignore_index=-100, reduction="sum")
        return total / (labels != -100).sum().clamp(min=1)

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the auxiliary losses the layers stored during the last forward."""
        total = 0.0
        for layer in self.model.layers:
            a = getattr(layer.mlp, "aux_loss", None)
            if a is not None:
                total = total + a
        return total

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        logits_indices: torch.Tensor | None = None,
        return_hidden: bool = False,
    ):
        """``positions [T]`` (optional) are the tokens' RoPE positions; ``logits_indices [K]``
        (optional) picks the flattened ``B*T`` rows whose logits are wanted (``[K, vocab]``);
        ``return_hidden``: those rows' final hidden states (after the final norm, ``[..., hidden]``)
        instead of logits, for a serving engine that applies ``lm_head`` itself (vLLM's
        ``compute_logits``)."""
        return self.forward_embeds(self.embed(input_ids), labels, positions, logits_indices, return_hidden)

    def forward_embeds(
        self,
        h: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        logits_indices: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """:meth:`forward` from the input embeddings ``h [B, T, hidden]`` on (a multimodal model
        writes its image tokens into them first): logits, or the loss with ``labels``, or with
        ``return_hidden`` the final norm's output."""
        h = self.run_layers(h) if positions is None else self.run_layers(h, positions=positions)
        if logits_indices is not None:
            h = h.flatten(0, -2)[logits_indices]
        if return_hidden:
            return self.model.norm(h)
        logits = self.head(h)
        if labels is None:
            return logits
        return self.compute_loss(logits, labels) + self.aux_loss()

    def fuse_projections(self) -> "LlamaForCausalLM":
        """Inference: q/k/v and gate/up each become one matmul over views of one weight (fewer
        kernel launches per layer); layers that are not plain ``nn.Linear`` are left as they are."""
        for layer in self.model.layers:
            attention: Any = layer.self_attn  # Attention (a submodule reads as Tensor | Module)
            attention.fuse()
            if type(layer.mlp) is MLP:
                layer.mlp.fuse()
        return self


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Seeded initialisation that depends only on ``seed`` and the parameter names.

    Each parameter gets its own generator seeded from ``(seed, name)``, so building the model in
    any order, or building only some layers, gives the same values. Linear and embedding weights
    are N(0, 0.02); output projections (``o_proj``, ``down_proj``) are scaled by 1/sqrt(2L) as in
    GPT-2/Megatron; norms are ones; biases zeros.
    """
    std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", 1)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            g = torch.Generator().manual_seed(_name_seed(seed, name))
            s = std / math.sqrt(2 * n_layers) if ("o_proj" in name or "down_proj" in name) else std
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * s)


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)
