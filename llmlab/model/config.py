"""Model configuration and presets.

A :class:`ModelConfig` describes a Llama-family decoder (RMSNorm, rotary embeddings, SwiGLU MLP,
grouped-query attention, optional tied embeddings, optional mixture-of-experts MLP). Field names
follow Hugging Face's ``LlamaConfig`` so that local checkpoints map onto it one to one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """Shape of the decoder. All sizes are counts (not bytes).

    ``num_experts = 0`` gives a dense SwiGLU MLP in every layer; ``num_experts > 0`` puts a
    mixture-of-experts MLP (``moe_intermediate_size`` per expert) in every layer.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections (Qwen2 style)
    o_proj_bias: bool = False  # bias on the output projection (Llama attention_bias=True)
    mlp_bias: bool = False
    initializer_range: float = 0.02
    # Mixture of experts (0 = dense).
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    capacity_factor: float | None = None  # None = dropless
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    # Attention details of some checkpoints (Hugging Face names and meaning).
    explicit_head_dim: int | None = None  # HF ``head_dim`` when it is not hidden / heads
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", "factor": ...}
    sliding_window: int | None = None  # keys per query (itself included) on sliding layers
    sliding_window_layers: tuple = ()  # indices of the layers that slide
    name: str = "custom"
    extra: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    def validate(self) -> "ModelConfig":
        """Raise ``ValueError`` naming the broken constraint."""
        if self.explicit_head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must divide hidden_size={self.hidden_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        rt = (self.rope_scaling or {}).get("rope_type", "default")
        if rt not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_scaling rope_type={rt!r} is not supported (default, linear, llama3)")
        if self.sliding_window_layers and not (self.sliding_window or 0) >= 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 on sliding layers")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"top-k={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")
        return self

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw).validate()

    def num_parameters(self) -> int:
        """Exact parameter count of :class:`~llmlab.model.llama.LlamaForCausalLM` (elements)."""
        h, v, L = self.hidden_size, self.vocab_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q * 2 + h * kv * 2
        if self.attention_bias:
            attn += q + 2 * kv
        if self.o_proj_bias:
            attn += h
        if self.num_experts:
            ffn = self.moe_intermediate_size or self.intermediate_size
            mlp = self.num_experts * 3 * h * ffn + h * self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + L * layer + h + head


PRESETS: dict[str, ModelConfig] = {
    # 4 layers, 4 heads, 2 kv heads, byte vocabulary: tp 2/4, pp 2/4 and pp2 x v2 all divide it.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    "tiny-moe": ModelConfig(
        name="tiny-moe",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
    ),
    # ~0.86 M parameters: the default inference model shipped in llmlab/assets/models/shakespeare
    # (trained on the first nine tenths of the bundled corpus; benchmarks/shakespeare_model.py, docs/inference.md).
    "shakespeare": ModelConfig(
        name="shakespeare",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    # ~6.6 M parameters: a few minutes on CPU, seconds on a GPU.
    "small": ModelConfig(
        name="small",
        vocab_size=256,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    # ~110 M parameters (GPT-2-small-like width), for GPUs.
    "base": ModelConfig(
        name="base",
        vocab_size=256,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    # ~1.2 B parameters, for multi-GPU nodes.
    "1b": ModelConfig(
        name="1b",
        vocab_size=256,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """Return a copy of a preset. Raises ``ValueError`` listing the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides)
