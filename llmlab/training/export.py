"""``llmlab train --save-model DIR``: the trained model as a Hugging Face checkpoint, from any layout.

The model is gathered through the reshardable training checkpoint (:mod:`llmlab.training.checkpoint`):
every rank writes the slices it holds (tensor-parallel shards, pipeline stages, ZeRO shards
all-gathered) under their full-model names into ``DIR/.llmlab-gather``; rank 0 assembles the full
tensors, takes the fp32 master weights when the run kept them (a bf16/fp16 run), builds the whole
:class:`~llmlab.model.llama.LlamaForCausalLM` and writes ``config.json`` + ``model.safetensors``
(:func:`llmlab.model.hf.save_hf_checkpoint`: ``transformers`` loads it, ``llmlab serve`` serves it),
plus the ``--init-from`` checkpoint's tokenizer files when there is one. ``DIR`` must be one folder
for all ranks (a shared filesystem across nodes), as ``--checkpoint-dir``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GATHER = ".llmlab-gather"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "added_tokens.json",
)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def full_weights(engine: Any, directory: Path) -> dict[str, torch.Tensor] | None:
    """Collective: the whole model's weights ``{name: fp32 tensor}`` on rank 0 (``None``
    elsewhere), gathered through a checkpoint written into ``directory``."""
    from llmlab.training.checkpoint import _assemble, _weights, save_checkpoint, verify

    path = save_checkpoint(engine, 0, 0.0, directory, keep=1)
    if path is None:
        return None
    full = _assemble(path, verify(path))
    return {n: _weights(full, n).float() for n in full if "::" not in n}


def save_model(engine: Any, directory: str | Path) -> None:
    """Collective: write the engine's model to ``directory`` as a Hugging Face checkpoint (see the
    module docstring), or, with ``--lora-rank``, its adapters as a PEFT adapter folder
    (:func:`llmlab.model.lora.save_peft_adapter`; the checkpoint holds only the trained tensors).
    Raises ``ValueError`` if the gathered tensors do not make the model."""
    from llmlab.model.hf import save_hf_checkpoint
    from llmlab.model.llama import LlamaForCausalLM

    directory = Path(directory)
    gather = directory / GATHER
    weights = full_weights(engine, gather)
    cfg = engine.cfg
    if weights is not None and getattr(cfg, "lora_rank", None) is not None:
        from llmlab.model.lora import parse_targets, save_peft_adapter

        save_peft_adapter(
            weights,
            directory,
            base=str(Path(cfg.init_from).resolve()),
            rank=cfg.lora_rank,
            alpha=cfg.lora_alpha,
            targets=parse_targets(cfg.lora_target),
        )
        shutil.rmtree(gather, ignore_errors=True)
    elif weights is not None:
        model = LlamaForCausalLM(engine.model_config, seed=None)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [
            m for m in missing if not (m == "lm_head.weight" and engine.model_config.tie_word_embeddings)
        ]
        if missing or unexpected:
            raise ValueError(
                f"--save-model: gathered tensors do not make the model: "
                f"missing={missing[:5]}, unexpected={unexpected[:5]}"
            )
        save_hf_checkpoint(model, directory)
        init = getattr(engine.cfg, "init_from", None)
        for name in TOKENIZER_FILES if init else ():
            if init and (Path(init) / name).is_file():
                shutil.copy(Path(init) / name, directory / name)
        shutil.rmtree(gather, ignore_errors=True)
    _barrier()
