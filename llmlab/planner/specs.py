"""What the planner is asked about: the model's shape and the workload.

:class:`ModelSpec` is a Llama-family decoder (GQA attention, SwiGLU or MoE MLP) described by its
counts; it comes from a preset (:func:`from_preset`), a Hugging Face ``config.json``
(:func:`from_hf_config`) or a parameter count with optional shape flags (:func:`from_params`,
which picks a Llama-like shape and solves the MLP width so the total is the count given).
:class:`Workload` is the sequence length, the global batch in tokens, the dtype, the optimizer
and the token budget.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """Counts (not bytes) of a decoder. ``num_experts = 0``: dense MLP of width ``ffn``."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    num_experts: int = 0
    top_k: int = 1
    moe_ffn: int = 0
    tied: bool = False
    name: str = "custom"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def attn_params(self) -> int:
        """q, k, v, o weights of one layer (no biases)."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * self.head_dim

    def dense_mlp_params(self) -> int:
        return 0 if self.num_experts else 3 * self.hidden * self.ffn

    def expert_params(self) -> int:
        """All experts of one layer (0 for a dense model)."""
        return self.num_experts * 3 * self.hidden * self.moe_ffn

    def layer_params(self) -> int:
        router = self.hidden * self.num_experts
        return self.attn_params() + self.dense_mlp_params() + self.expert_params() + router + 2 * self.hidden

    def num_params(self) -> int:
        """Total parameters, as :meth:`llmlab.model.config.ModelConfig.num_parameters` counts."""
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.num_layers * self.layer_params() + self.hidden + head

    def active_params(self) -> int:
        """Parameters one token goes through (top-k experts of each MoE layer)."""
        unused = self.num_experts - self.top_k if self.num_experts else 0
        return self.num_params() - self.num_layers * unused * 3 * self.hidden * self.moe_ffn

    def to_dict(self) -> dict:
        return asdict(self) | {"num_params": self.num_params()}

    def validate(self) -> "ModelSpec":
        """Raise ``ValueError`` naming the broken constraint (and the ``llmlab plan`` flag):
        every count an integer >= 1 (the MLP width of a dense model, the experts' of a MoE one),
        heads divide the hidden size, key/value heads divide the heads, top-k <= experts."""
        counts = {
            "num_layers (--num-layers)": self.num_layers,
            "hidden (--hidden-size)": self.hidden,
            "heads (--num-heads)": self.heads,
            "kv_heads (--num-kv-heads)": self.kv_heads,
            "vocab (--vocab-size)": self.vocab,
            "moe_ffn" if self.num_experts else "ffn": self.moe_ffn if self.num_experts else self.ffn,
        }
        for name, v in counts.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{self.name}: {name} must be an integer >= 1, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"{self.name}: heads {self.heads} (--num-heads) must divide hidden "
                f"{self.hidden} (--hidden-size)"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{self.name}: kv_heads {self.kv_heads} (--num-kv-heads) must divide "
                f"heads {self.heads} (--num-heads)"
            )
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"{self.name}: top_k {self.top_k} must be in 1..{self.num_experts} (the experts)"
            )
        return self


@dataclass(frozen=True)
class Workload:
    """One training step: ``global_batch_tokens`` tokens in sequences of ``seq_len``."""

    seq_len: int = 4096
    global_batch_tokens: int = 4 * 2**20
    dtype: str = "bf16"
    optimizer: str = "adam"
    token_budget: float = 2.5e11

    @property
    def global_batch_size(self) -> int:
        """Sequences per step."""
        return self.global_batch_tokens // self.seq_len

    def validate(self) -> "Workload":
        if not (
            isinstance(self.token_budget, (int, float))
            and math.isfinite(self.token_budget)
            and self.token_budget > 0
        ):
            raise ValueError(
                f"--tokens (the token budget) must be a finite number > 0, got {self.token_budget!r}"
            )
        if self.seq_len < 1 or self.global_batch_tokens < self.seq_len:
            raise ValueError(
                f"--global-batch-tokens {self.global_batch_tokens} must be at least "
                f"one sequence of --seq-len {self.seq_len} (and both >= 1)"
            )
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"--seq-len {self.seq_len} must divide --global-batch-tokens "
                f"{self.global_batch_tokens} (whole sequences per step)"
            )
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"--dtype {self.dtype!r}: expected fp32, bf16 or fp16")
        return self


# Published shapes (the models' config.json files), for ``--model``.
LARGE_MODELS = {
    "llama3-8b": ModelSpec(32, 4096, 32, 8, 14336, 128256, name="llama3-8b"),
    "qwen3-8b": ModelSpec(36, 4096, 32, 8, 12288, 151936, name="qwen3-8b"),
    "llama3-70b": ModelSpec(80, 8192, 64, 8, 28672, 128256, name="llama3-70b"),
    "mixtral-8x7b": ModelSpec(
        32, 4096, 32, 8, 14336, 32000, num_experts=8, top_k=2, moe_ffn=14336, name="mixtral-8x7b"
    ),
}


def from_preset(name: str) -> ModelSpec:
    """A published shape (:data:`LARGE_MODELS`) or an llmlab preset (``tiny``, ``small``, ...)
    as a spec; ``ValueError`` naming both lists for another name."""
    from llmlab.model.config import PRESETS, get_preset

    if name in LARGE_MODELS:
        return LARGE_MODELS[name]
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join([*LARGE_MODELS, *PRESETS])}")
    return from_model_config(get_preset(name))


def from_model_config(mc) -> ModelSpec:
    return ModelSpec(
        mc.num_hidden_layers,
        mc.hidden_size,
        mc.num_attention_heads,
        mc.num_key_value_heads,
        mc.intermediate_size,
        mc.vocab_size,
        mc.num_experts,
        mc.num_experts_per_tok if mc.num_experts else 1,
        mc.moe_intermediate_size or (mc.intermediate_size if mc.num_experts else 0),
        mc.tie_word_embeddings,
        mc.name,
    )


def from_hf_config(path: str | Path) -> ModelSpec:
    """A Hugging Face ``config.json`` (Llama, Qwen2, Mistral, Mixtral keys)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    c = json.loads(p.read_text())
    heads = c["num_attention_heads"]
    experts = c.get("num_local_experts") or c.get("num_experts") or 0
    return ModelSpec(
        c["num_hidden_layers"],
        c["hidden_size"],
        heads,
        c.get("num_key_value_heads") or heads,
        c["intermediate_size"],
        c["vocab_size"],
        experts,
        c.get("num_experts_per_tok", 1) if experts else 1,
        c.get("moe_intermediate_size") or (c["intermediate_size"] if experts else 0),
        bool(c.get("tie_word_embeddings", False)),
        c.get("model_type", p.parent.name),
    )


def from_params(
    num_params: float,
    num_layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    vocab: int = 32000,
) -> ModelSpec:
    """A dense Llama-like shape of ``num_params`` parameters.

    Missing sizes follow common practice: hidden ≈ (128·N/12)^(1/3) rounded to a multiple of
    1024 (256 below 2048), 128-wide heads, layers ≈ N/(12·h²), kv heads = heads; the MLP width
    is then solved so the parameter count is ``num_params`` (to within one column).
    Raises ``ValueError`` when the count is too small for the shape given.
    """
    if not (isinstance(num_params, (int, float)) and math.isfinite(num_params) and num_params > 0):
        raise ValueError(f"--params must be a finite number > 0, got {num_params!r}")
    for name, v in (
        ("--num-layers", num_layers),
        ("--hidden-size", hidden),
        ("--num-heads", heads),
        ("--num-kv-heads", kv_heads),
        ("--vocab-size", vocab),
    ):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")  # never a default
    if hidden is None:
        h = (128 * num_params / 12) ** (1 / 3)
        step = 1024 if h >= 2048 else 256 if h >= 256 else 64
        hidden = max(step, round(h / step) * step)
    heads = max(1, hidden // 128) if heads is None else heads
    kv_heads = heads if kv_heads is None else kv_heads
    num_layers = max(1, round(num_params / (12 * hidden * hidden))) if num_layers is None else num_layers
    ModelSpec(num_layers, hidden, heads, kv_heads, 1, vocab, name=f"--params {num_params:g}").validate()
    base = ModelSpec(num_layers, hidden, heads, kv_heads, 0, vocab)  # all but the MLP
    rest = num_params - base.num_params()
    ffn = math.floor(rest / (3 * hidden * num_layers))
    if ffn < 1:
        raise ValueError(
            f"--params {num_params:g} is too small for {num_layers} layers of hidden "
            f"size {hidden} and a vocabulary of {vocab}"
        )
    return ModelSpec(num_layers, hidden, heads, kv_heads, ffn, vocab, name=f"{num_params:.3g}")
