"""What ``llmlab plan --serve`` is asked about: the model as the KV cache sees it, and the workload.

:class:`ServeModel` carries what serving costs depend on: layers, KV heads and head size (GQA and
an explicit ``head_dim`` included), the parameter count (weights read every decode step), and the
sliding-window layers (their attention reads at most ``sliding_window`` tokens). It comes from a
preset (:data:`SERVE_MODELS`, the published config.json shapes, or any ``llmlab plan`` preset),
a Hugging Face ``config.json`` (:func:`serve_model_from_hf_config`: Llama, Qwen2, Qwen3, Mistral,
Mixtral; another family is refused by name) or a parameter count.
:class:`ServeWorkload` holds the settings of the engine (vLLM's names) and the requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from llmlab.formulas.serving import SERVE_DTYPE_BYTES


@dataclass(frozen=True)
class ServeModel:
    """Counts (not bytes). ``active_params``: parameters one token goes through (MoE: top-k)."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    num_params: int
    active_params: int
    max_position: int = 131072
    sliding_window: int | None = None
    sliding_layers: int = 0  # how many layers slide (the engine still gives them full KV)

    def to_dict(self) -> dict:
        return asdict(self)


def _params(
    L: int,
    h: int,
    heads: int,
    kv: int,
    hd: int,
    ffn: int,
    vocab: int,
    tied: bool,
    qkv_bias: bool = False,
    experts: int = 0,
    top_k: int = 1,
    moe_ffn: int = 0,
) -> tuple[int, int]:
    attn = 2 * h * heads * hd + 2 * h * kv * hd + ((heads + 2 * kv) * hd if qkv_bias else 0)
    mlp = 3 * h * ffn if not experts else experts * 3 * h * moe_ffn + h * experts
    total = vocab * h * (1 if tied else 2) + L * (attn + mlp + 2 * h) + h
    active = total - (L * (experts - top_k) * 3 * h * moe_ffn if experts else 0)
    return total, active


def _model(
    name: str,
    L: int,
    h: int,
    heads: int,
    kv: int,
    ffn: int,
    vocab: int,
    hd: int | None = None,
    tied: bool = False,
    qkv_bias: bool = False,
    max_pos: int = 131072,
    window: int | None = None,
    sliding: int = 0,
    experts: int = 0,
    top_k: int = 1,
    moe_ffn: int = 0,
) -> ServeModel:
    hd = hd or h // heads
    total, active = _params(L, h, heads, kv, hd, ffn, vocab, tied, qkv_bias, experts, top_k, moe_ffn)
    return ServeModel(name, L, h, heads, kv, hd, ffn, vocab, total, active, max_pos, window, sliding)


# Published config.json shapes.
SERVE_MODELS = {
    "llama2-7b": _model("llama2-7b", 32, 4096, 32, 32, 11008, 32000, max_pos=4096),
    "llama3-8b": _model("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "qwen2.5-7b": _model("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, qkv_bias=True, max_pos=32768),
    "qwen3-8b": _model("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, hd=128, max_pos=40960),
    "llama3-70b": _model("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "qwen2.5-72b": _model("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, qkv_bias=True, max_pos=32768),
    "mixtral-8x7b": _model(
        "mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2, moe_ffn=14336, max_pos=32768
    ),
}
HF_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "mixtral")


def serve_model_from_hf_config(path: str | Path) -> ServeModel:
    """A Hugging Face ``config.json`` (or its directory). ``ValueError`` for a family outside
    :data:`HF_FAMILIES` or a missing key; ``FileNotFoundError`` for no file."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"--config: no config.json at {path}")
    try:
        c = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}: not JSON ({e})") from None
    if not isinstance(c, dict):
        raise ValueError(f"--config {path}: expected a JSON object of a model's config")
    family = c.get("model_type")
    if family not in HF_FAMILIES:
        raise ValueError(
            f"--config {path}: model_type {family!r} is not supported by the serving "
            f"planner; supported: {', '.join(HF_FAMILIES)}"
        )
    missing = [
        k
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        if not c.get(k)
    ]
    if missing:
        raise ValueError(f"--config {path}: lacks {', '.join(missing)}")
    L, heads = c["num_hidden_layers"], c["num_attention_heads"]
    layer_types = c.get("layer_types") or []
    if layer_types:
        sliding = sum(t == "sliding_attention" for t in layer_types)
    elif family == "mistral" or (family == "mixtral"):
        sliding = L if c.get("sliding_window") else 0
    elif c.get("use_sliding_window") and c.get("sliding_window"):  # Qwen2's older rule
        sliding = L - min(L, c.get("max_window_layers", 0))
    else:
        sliding = 0
    experts = c.get("num_local_experts") or 0
    return _model(
        c.get("_name_or_path") or p.parent.name or family,
        L,
        c["hidden_size"],
        heads,
        c.get("num_key_value_heads") or heads,
        c["intermediate_size"],
        c["vocab_size"],
        hd=c.get("head_dim"),
        tied=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(c.get("attention_bias", False)),
        max_pos=c.get("max_position_embeddings", 131072),
        window=c.get("sliding_window") if sliding else None,
        sliding=sliding,
        experts=experts,
        top_k=c.get("num_experts_per_tok", 1) if experts else 1,
        moe_ffn=c["intermediate_size"] if experts else 0,
    )


def serve_model(
    model: str | ServeModel | None = None,
    params: float | None = None,
    config: str | Path | None = None,
    **shape: int | None,
) -> ServeModel:
    """Exactly one of a preset name (:data:`SERVE_MODELS` or a ``llmlab plan`` preset), a
    :class:`ServeModel`, ``params`` (with optional shape keywords) or ``config``."""
    if sum(x is not None for x in (model, params, config)) != 1:
        raise ValueError("give exactly one of --model PRESET, --params N or --config config.json")
    if isinstance(model, ServeModel):
        return model
    if config is not None:
        return serve_model_from_hf_config(config)
    if model in SERVE_MODELS:
        return SERVE_MODELS[model]
    from llmlab.planner.specs import from_params, from_preset

    if model is not None:
        s = from_preset(model)
    elif params is not None:
        s = from_params(params, **{k: v for k, v in shape.items() if v is not None})
    else:  # (one of the three is given: checked above)
        raise ValueError("give exactly one of --model PRESET, --params N or --config config.json")
    max_pos = 131072
    if model is not None:
        from llmlab.model.config import PRESETS, get_preset

        if model in PRESETS:
            max_pos = get_preset(model).max_position_embeddings
    return ServeModel(
        s.name,
        s.num_layers,
        s.hidden,
        s.heads,
        s.kv_heads,
        s.head_dim,
        s.ffn or s.moe_ffn,
        s.vocab,
        s.num_params(),
        s.active_params(),
        max_pos,
    )


@dataclass(frozen=True)
class ServeWorkload:
    """The engine's settings and the requests. Tokens, bytes as named; vLLM's names.

    ``max_model_len`` None: the model's own context; ``concurrency``: requests in flight over
    the whole deployment (else ``request_rate`` requests/s; neither: as many as fit)."""

    prompt_len: int = 1024
    output_len: int = 256
    max_model_len: int | None = None
    concurrency: int | None = None
    request_rate: float | None = None
    weight_dtype: str = "bf16"
    kv_dtype: str = "auto"  # auto: the weights' dtype (bf16 under int8/int4/fp8 weights)
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len), as llmlab's engine

    @property
    def kv_cache_dtype(self) -> str:
        if self.kv_dtype != "auto":
            return self.kv_dtype
        return self.weight_dtype if self.weight_dtype in ("fp32", "bf16", "fp16") else "bf16"

    def validate(self) -> "ServeWorkload":
        for name in ("prompt_len", "output_len", "block_size", "max_num_seqs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)!r}"
                )
        for name in ("max_model_len", "concurrency", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.request_rate is not None and not (math.isfinite(self.request_rate) and self.request_rate > 0):
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if not (math.isfinite(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.weight_dtype not in SERVE_DTYPE_BYTES:
            raise ValueError(
                f"--weight-dtype {self.weight_dtype!r}: expected one of {', '.join(SERVE_DTYPE_BYTES)}"
            )
        if self.kv_cache_dtype not in ("fp32", "bf16", "fp16", "fp8"):
            raise ValueError(f"--kv-dtype {self.kv_dtype!r}: expected auto, fp32, bf16, fp16 or fp8")
        return self

    def resolved(self, model: ServeModel) -> "ServeWorkload":
        """Defaults filled from the model: ``max_model_len`` (its context) and
        ``max_num_batched_tokens``. ``ValueError`` when the requests exceed ``max_model_len``."""
        mml = self.max_model_len or model.max_position
        if mml > model.max_position:
            raise ValueError(
                f"--max-model-len {mml} is larger than {model.name}'s context "
                f"(max_position_embeddings {model.max_position})"
            )
        if self.prompt_len + self.output_len > mml:
            raise ValueError(
                f"--prompt-len {self.prompt_len} + --output-len {self.output_len} "
                f"exceed --max-model-len {mml}"
            )
        return replace(
            self, max_model_len=mml, max_num_batched_tokens=self.max_num_batched_tokens or max(2048, mml)
        )
