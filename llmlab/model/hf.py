"""Load a local Hugging Face Llama or Qwen2 checkpoint into :class:`LlamaForCausalLM`.

The directory holds ``config.json`` and ``model.safetensors`` (or sharded
``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``). The config is read
with ``transformers.AutoConfig`` and the weights with ``safetensors``; no network access.
Parameter names already match, so loading is a ``load_state_dict``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM

SUPPORTED = ("llama", "qwen2")


def config_from_hf(hf_config) -> ModelConfig:
    """Map a ``transformers`` config to :class:`ModelConfig`, every field that changes the maths
    either carried over or refused by name.

    Carried over: explicit ``head_dim``; RoPE ``rope_theta`` and scaling types ``linear`` and
    ``llama3`` (from ``rope_parameters``, or ``rope_scaling`` in older configs); sliding-window
    attention on the layers transformers itself makes slide (its ``layer_types``: for Qwen2 the
    layers from ``max_window_layers`` on when ``use_sliding_window``), so a config that merely
    carries an unused ``sliding_window`` loads as full attention.
    Raises ``ValueError`` naming the field for architectures or options llmlab does not implement
    (model types other than ``llama``/``qwen2``, other RoPE types, activations other than silu,
    ``layer_types`` other than full and sliding attention).
    """
    mt = getattr(hf_config, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(f"model_type={mt!r} is not supported; llmlab loads {', '.join(SUPPORTED)}")
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(
            f"rope_scaling rope_type={rope_type!r} is not supported (default, linear, llama3): {rope}"
        )
    theta = float(rope.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)
    scaling = (
        None
        if rope_type == "default"
        else {k: v for k, v in rope.items() if k not in ("rope_theta", "type")} | {"rope_type": rope_type}
    )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (SwiGLU uses silu)")
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if (
        not layer_types
        and getattr(hf_config, "use_sliding_window", False)
        and getattr(hf_config, "sliding_window", None)
    ):  # transformers before layer_types
        first = getattr(hf_config, "max_window_layers", 0)
        sliding = tuple(range(first, hf_config.num_hidden_layers))
    other = {t for t in layer_types} - {"full_attention", "sliding_attention"}
    if other:
        raise ValueError(f"layer_types {sorted(other)} are not supported")
    window = getattr(hf_config, "sliding_window", None) if sliding else None
    H = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None)
    qkv_bias = mt == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return ModelConfig(
        name=str(getattr(hf_config, "_name_or_path", mt)) or mt,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=H,
        num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or H,
        max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=mt == "llama" and bool(getattr(hf_config, "attention_bias", False)),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        explicit_head_dim=(int(head_dim) if head_dim and head_dim * H != hf_config.hidden_size else None),
        rope_scaling=scaling,
        sliding_window=window,
        sliding_window_layers=sliding,
    ).validate()


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in ``path`` (single file or sharded), on CPU."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(path / f)))
    return state


def is_hf_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build the model from a local HF checkpoint directory.

    Raises ``FileNotFoundError`` (no config/weights), ``ValueError`` (unsupported architecture or
    missing/unexpected tensors).
    """
    from transformers import AutoConfig

    path = Path(path)
    if not is_hf_checkpoint(path):
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
    config = config_from_hf(AutoConfig.from_pretrained(str(path), local_files_only=True))
    model = LlamaForCausalLM(config, seed=None)
    load_into(model, load_state_dict(path), config.tie_word_embeddings, path, "the model")
    return model.to(dtype)


def load_into(model: torch.nn.Module, state: dict, tied: bool, path: object, what: str) -> None:
    """Load a checkpoint's ``state`` (llmlab names) into ``model``: the rotary tables dropped, a
    tied ``lm_head.weight`` left to the embedding; ``ValueError`` naming ``what`` when tensors
    are missing or unexpected."""
    state = {
        k: v
        for k, v in state.items()
        if "rotary_emb.inv_freq" not in k and not (tied and k == "lm_head.weight")
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match {what}: missing={missing[:5]}, unexpected={unexpected[:5]}"
        )


def hf_config_dict(config: ModelConfig) -> dict:
    """``config.json`` contents (Hugging Face ``LlamaConfig`` fields) for an llmlab model."""
    if config.num_experts:
        raise ValueError("mixture-of-experts models cannot be written as a Llama checkpoint")
    if config.sliding_window_layers:
        raise ValueError("sliding-window models cannot be written as a Llama checkpoint")
    if config.o_proj_bias != config.attention_bias:
        model_type, bias = "qwen2", {}
        if config.o_proj_bias or not config.attention_bias:
            raise ValueError("bias layout has no Hugging Face equivalent")
    else:
        model_type, bias = "llama", {"attention_bias": config.attention_bias}
    return {
        "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "mlp_bias": config.mlp_bias,
        "torch_dtype": "float32",
        **bias,
        **({"head_dim": config.explicit_head_dim} if config.explicit_head_dim else {}),
        **({"rope_scaling": dict(config.rope_scaling)} if config.rope_scaling else {}),
    }


def save_hf_checkpoint(model: LlamaForCausalLM, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that both llmlab and ``transformers`` load.

    This is llmlab's own single-file model format too. ``dtype`` (e.g. ``torch.bfloat16``)
    converts floating tensors to halve the file. Returns the directory.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_dict(model.config)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
