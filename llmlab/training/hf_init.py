"""``llmlab train --init-from DIR``: start training from a Hugging Face Llama or Qwen2 checkpoint.

Every rank builds the *whole* model from the checkpoint's weights (instead of the seeded
initialisation) and then shards it exactly as it shards a preset: tensor parallelism, pipeline
stages and ZeRO cut their pieces out of the full model, so each layout starts from the same
weights and the one-rank run and every layout give the same losses (the layouts' contract). The
checkpoint's tokenizer turns the training text into tokens: the bundled corpus when no ``--data``
is given, else the examples of ``--data`` (:mod:`llmlab.data.jsonl`).

Which fields of ``config.json`` are carried over, and which are refused by name, is
:func:`llmlab.model.hf.config_from_hf`'s business; an unsupported family (``model_type`` other
than ``llama``/``qwen2``) is a ``ValueError`` before any rank starts.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM


def check_checkpoint_dir(path: str) -> Path:
    """The checkpoint folder of ``--init-from``; ``ValueError`` naming the flag when it is not a
    folder with ``config.json`` and safetensors weights."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(
            f"--init-from {path!r} is not a folder (a Hugging Face checkpoint: "
            f"config.json + model.safetensors + tokenizer)"
        )
    if not (p / "config.json").is_file():
        raise ValueError(f"--init-from {path!r} has no config.json: not a Hugging Face checkpoint")
    if not ((p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()):
        raise ValueError(
            f"--init-from {path!r} has no model.safetensors (or sharded index); "
            f"llmlab reads safetensors weights only"
        )
    return p


@functools.lru_cache(maxsize=8)
def hf_model_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint in ``path``. Raises ``ValueError`` naming the
    flag and the field for an unsupported family or option."""
    import json

    from llmlab.model.hf import config_from_hf

    p = check_checkpoint_dir(path)
    try:
        model_type = json.loads((p / "config.json").read_text()).get("model_type")
    except ValueError as e:
        raise ValueError(f"--init-from {path!r}: config.json is not valid JSON ({e})") from None
    if model_type not in ("llama", "qwen2"):
        raise ValueError(
            f"--init-from {path!r}: model_type={model_type!r} is not supported; "
            f"llmlab trains llama and qwen2 checkpoints"
        )
    from transformers import AutoConfig

    try:
        return config_from_hf(AutoConfig.from_pretrained(str(p), local_files_only=True))
    except ValueError as e:
        raise ValueError(f"--init-from {path!r}: {e}") from None


def load_pretrained(path: str) -> LlamaForCausalLM:
    """The whole model with the checkpoint's weights, fp32, on CPU."""
    from llmlab.model.hf import load_hf_model

    return load_hf_model(path, dtype=torch.float32)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer (``transformers.AutoTokenizer``, local files only); raises
    ``ValueError`` naming the flag when the folder has none."""
    p = Path(path)
    if not any(
        (p / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        raise ValueError(
            f"--init-from {path!r} has no tokenizer files (tokenizer.json, "
            f"tokenizer_config.json, ...): the training text cannot be tokenized"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p), local_files_only=True)


def corpus_token_ids(path: str, split: str = "train") -> torch.Tensor:
    """The bundled corpus (:func:`llmlab.data.corpus_tokens`' split, by bytes) as the checkpoint's
    tokens ``[N]`` int64: the text ``--init-from`` trains on when no ``--data`` is given."""
    from llmlab.data import HELDOUT_FRACTION, load_corpus

    text = load_corpus()
    cut = len(text) - int(len(text) * HELDOUT_FRACTION)
    part = {"train": text[:cut], "heldout": text[cut:], "all": text}[split]
    ids = load_tokenizer(path).encode(part, add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.long)
