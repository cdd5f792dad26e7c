"""Find the model and tokenizer behind ``--model``: a shipped preset, a checkpoint directory, or
a model object.

- A *preset* name (``shakespeare``, ``tiny``, ...) is a model llmlab trains itself; when weights
  for it are shipped in ``llmlab/assets/models/<name>/`` they are used (no download).
- A *directory* with ``config.json`` + safetensors: a local Hugging Face Llama/Qwen2 checkpoint, a
  Qwen2.5-VL one (:mod:`llmlab.model.qwen2_5_vl`, images in), or a model written by
  ``llmlab train --save-model`` (the same format).
- An ``LlamaForCausalLM`` instance, or a ``ModelConfig`` (random weights from ``init_weights``,
  seed 0: for tests and labs).

Tokenizer: the checkpoint's own (``transformers.AutoTokenizer``) when it has tokenizer files,
otherwise llmlab's :class:`~llmlab.data.ByteTokenizer` for a 256-symbol vocabulary, otherwise none
(then prompts must be token ids).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from llmlab.model.config import PRESETS, ModelConfig
from llmlab.model.llama import LlamaForCausalLM

DEFAULT_MODEL = "shakespeare"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def shipped_model_dir(name: str) -> Path | None:
    """``llmlab/assets/models/<name>`` if weights for that preset ship with the package."""
    d = Path(str(resources.files("llmlab"))) / "assets" / "models" / name
    return d if (d / "config.json").is_file() else None


def resolve_model_path(spec: str) -> Path:
    """Directory holding the model ``spec`` names. Raises ``FileNotFoundError`` with what to do."""
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(
                f"{p} has no config.json: not a model directory (expected a "
                "Hugging Face checkpoint or `llmlab train --save-model` output)"
            )
        return p
    shipped = shipped_model_dir(spec)
    if shipped is not None:
        return shipped
    if spec in PRESETS:
        raise FileNotFoundError(
            f"no trained weights ship for preset {spec!r}; train them with `llmlab train --model "
            f"{spec} --save-model DIR` and pass --model DIR (weights ship for: "
            f"{', '.join(n for n in PRESETS if shipped_model_dir(n)) or 'none'})"
        )
    raise FileNotFoundError(f"--model {spec!r} is neither a directory nor a preset ({', '.join(PRESETS)})")


def load_tokenizer(path: Path, vocab_size: int) -> Any:
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if vocab_size == 256:
        from llmlab.data import ByteTokenizer

        return ByteTokenizer()
    return None


def eos_token_id(path: Path) -> list[int]:
    """End-of-sequence ids from ``generation_config.json`` (else ``config.json``), as HF does."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return list(eos) if isinstance(eos, list) else [int(eos)]
    return []


# generation_config.json key -> SamplingParams field (those vLLM's generation_config="auto" reads)
GENERATION_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(path: Path) -> dict[str, Any]:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets, as ``SamplingParams``
    fields (``{"repetition_penalty": 1.05, "temperature": 0.7, ...}``; only keys present in the
    file, as vLLM's ``generation_config="auto"``); ``{}`` without the file."""
    f = path / "generation_config.json"
    if not f.is_file():
        return {}
    cfg = json.loads(f.read_text())
    return {field: cfg[key] for key, field in GENERATION_DEFAULT_KEYS.items() if cfg.get(key) is not None}


# What an engine is given as its model: a preset name or checkpoint folder, a config or a model.
ModelSpec = LlamaForCausalLM | ModelConfig | str | Path


def load(model: ModelSpec, tokenizer: Any = None) -> tuple[LlamaForCausalLM, Any, list[int], dict[str, Any]]:
    """Returns ``(LlamaForCausalLM, tokenizer or None, eos ids, generation defaults)`` for any
    accepted ``model`` (see :func:`generation_defaults`; ``{}`` for model objects)."""
    from llmlab.data import ByteTokenizer

    if isinstance(model, LlamaForCausalLM):
        tok = tokenizer or (ByteTokenizer() if model.config.vocab_size == 256 else None)
        return model, tok, [], {}
    if isinstance(model, ModelConfig):
        tok = tokenizer or (ByteTokenizer() if model.vocab_size == 256 else None)
        return LlamaForCausalLM(model, seed=0), tok, [], {}
    from llmlab.model.hf import load_hf_model
    from llmlab.model.qwen2_5_vl import MODEL_TYPES, load_qwen2_5_vl

    path = resolve_model_path(str(model))
    vision = json.loads((path / "config.json").read_text()).get("model_type") in MODEL_TYPES
    m = load_qwen2_5_vl(path) if vision else load_hf_model(path)
    return (
        m,
        tokenizer or load_tokenizer(path, m.config.vocab_size),
        eos_token_id(path),
        generation_defaults(path),
    )
