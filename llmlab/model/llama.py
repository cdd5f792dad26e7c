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

import torch
import torch.nn.functional as F
from torch import nn

from llmlab import kernels
from llmlab.model.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in fp32 like HF Llama."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.use_fused("rmsnorm", x):      # opt-in fused Triton kernel (llmlab.kernels)
            return kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for RoPE (Su et al. 2021), shape ``positions.shape + (head_dim,)``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
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


class Attention(nn.Module):
    """Causal grouped-query self-attention. ``forward(x [B,T,h], cos, sin) -> [B,T,h]``.

    ``num_heads``/``num_kv_heads`` are the heads this module holds: all of them on one device,
    ``1/tp`` of them under tensor parallelism (the TP wrapper updates them).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, D = config.hidden_size, config.head_dim
        self.head_dim = D
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(h, self.num_heads * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, h, bias=config.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if kernels.use_fused("attention", q):    # opt-in flash attention (llmlab.kernels)
            out = kernels.attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, ``[B,T,h] -> [B,T,h]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if kernels.use_fused("swiglu", gate):      # opt-in fused Triton kernel (llmlab.kernels)
            return self.down_proj(kernels.swiglu(gate, up))
        return self.down_proj(F.silu(gate) * up)


def make_mlp(config: ModelConfig) -> nn.Module:
    """The MLP slot of a decoder layer: dense SwiGLU, or a mixture of experts."""
    if config.num_experts:
        try:
            from llmlab.model.moe import MoE
        except ImportError as e:  # pragma: no cover - only before the MoE layer exists
            raise NotImplementedError("mixture-of-experts layers are not supported yet") from e
        return MoE(config)
    return MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def rotary(self, T: int, device, dtype, offset: int = 0):
        pos = torch.arange(offset, offset + T, device=device)
        return rotary_cos_sin(pos, self.config.head_dim, self.config.rope_theta, dtype)

    def run_layers(self, hidden: torch.Tensor, layers=None, seq_len: int | None = None) -> torch.Tensor:
        """Apply ``layers`` (default: all) to ``hidden [B,T,h]``. ``seq_len`` overrides T for RoPE
        when the hidden state is sharded along the sequence."""
        T = seq_len if seq_len is not None else hidden.shape[1]
        cos, sin = self.rotary(T, hidden.device, hidden.dtype)
        for layer in (self.model.layers if layers is None else layers):
            hidden = layer(hidden, cos, sin)
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over labels ``!= -100`` (0, not nan, if every label is
        ignored: a micro-batch of padding only adds nothing)."""
        labels = labels.flatten()
        total = F.cross_entropy(logits.float().flatten(0, -2), labels, ignore_index=-100,
                                reduction="sum")
        return total / (labels != -100).sum().clamp(min=1)

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the auxiliary losses the layers stored during the last forward."""
        total = 0.0
        for layer in self.model.layers:
            a = getattr(layer.mlp, "aux_loss", None)
            if a is not None:
                total = total + a
        return total

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.head(self.run_layers(self.embed(input_ids)))
        if labels is None:
            return logits
        return self.compute_loss(logits, labels) + self.aux_loss()


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
