"""Qwen2.5-VL: the vision tower (:mod:`llmlab.model.qwen2_5_vl_vision`) in front of a Qwen2
language model whose rotary positions are multimodal (:mod:`llmlab.model.mrope`).

The language model is :class:`~llmlab.model.llama.LlamaForCausalLM` itself (same layers, same
parameter names); only its rotary tables change, from ``positions [N]`` to ``positions [3, N]``,
and its embedding step, where the rows of image placeholder tokens are replaced by the vision
tower's output (Hugging Face's ``masked_scatter``). Loaded from a Hugging Face
``Qwen2_5_VLForConditionalGeneration`` checkpoint by :func:`load_qwen2_5_vl`; a Qwen2-VL one
(``Qwen2VLForConditionalGeneration``: LayerNorm and QuickGELU vision blocks, no windows) loads
into the same class with ``VisionConfig.variant = "qwen2_vl"``.
"""

from __future__ import annotations

import types
from typing import Any
from dataclasses import dataclass, field

import torch

from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM
from llmlab.model.mrope import mrope_cos_sin
from llmlab.model.qwen2_5_vl_vision import VisionConfig, VisionTransformer

MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


@dataclass
class MultimodalConfig:
    """What the engine and the processor need to know about the image path: the special token
    ids (``image_token_id`` is the placeholder repeated once per image token), the vision
    config and the M-RoPE ``mrope_section``."""

    vision: VisionConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])

    @property
    def pixels_per_token(self) -> int:
        """Side of the square of pixels one image token covers (28 = 14 x 2)."""
        return self.vision.patch_size * self.vision.spatial_merge_size


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """The vision-language model. ``forward(input_ids [1, N], *, positions [3, N] | [N],
    logits_indices, image_embeds [K, h], image_mask [N] bool, return_hidden)``: the ``K`` rows where
    ``image_mask`` is set take ``image_embeds`` (from :meth:`encode_images`) instead of the token
    embedding. ``positions`` of shape ``[N]`` (text only) means the same id on all three axes."""

    is_multimodal = True

    def __init__(self, config: ModelConfig, mm: MultimodalConfig, seed: int | None = None):
        super().__init__(config, seed)
        self.mm_config = mm
        if mm.vision.out_hidden_size != config.hidden_size:
            raise ValueError(
                f"vision out_hidden_size={mm.vision.out_hidden_size} must equal the "
                f"language model's hidden_size={config.hidden_size}"
            )
        self.visual = VisionTransformer(mm.vision)

    def rotary_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[N, head_dim]`` for ids ``[3, N]`` (or ``[N]``, text only)."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        c = self.config
        return mrope_cos_sin(positions, c.head_dim, c.rope_theta, self.mm_config.mrope_section, dtype)

    def rotary(
        self, T: int, device: Any, dtype: torch.dtype, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_at(torch.arange(offset, offset + T, device=device), dtype)

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Image tokens ``[sum(t*h*w) / 4, hidden]`` of the images whose patches are
        ``pixel_values [P, patch_dim]`` and grids ``grid_thw [I, 3]``."""
        dev = self.lm_head.weight.device
        dtype = self.visual.patch_embed.proj.weight.dtype
        return self.visual(pixel_values.to(dev, dtype), grid_thw)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        logits_indices: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        h = self.embed(input_ids)
        if image_embeds is not None and image_embeds.shape[0]:
            assert image_mask is not None, "image_embeds need their image_mask"
            flat = h.view(-1, h.shape[-1])
            flat[image_mask.view(-1)] = image_embeds.to(h.dtype)
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        return self.forward_embeds(h, labels, positions, logits_indices, return_hidden)


def small_qwen2_5_vl(seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    """A small random Qwen2.5-VL for benchmarks and lab 14 (no checkpoint needed): byte vocabulary
    (256; image / vision-start / vision-end ids 255 / 254 / 253, bytes UTF-8 never produces), a
    2-layer language model of width 128 and a 4-block vision tower (window 112 pixels, block 3 full
    attention), M-RoPE sections [4, 6, 6]. Same weights for the same ``seed``."""
    cfg = ModelConfig(
        name="vl-small",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        attention_bias=True,
    )
    vision = VisionConfig(
        depth=4,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=128,
        window_size=112,
        fullatt_block_indexes=(3,),
    )
    return Qwen2_5_VLForConditionalGeneration(
        cfg, MultimodalConfig(vision, 255, 254, 253, [4, 6, 6]), seed=seed
    )


def configs_from_hf(path: Any) -> tuple[ModelConfig, MultimodalConfig]:
    """The language model's :class:`ModelConfig` and the :class:`MultimodalConfig` of a
    Hugging Face Qwen2.5-VL or Qwen2-VL ``config.json`` in ``path`` (read as JSON: the text config as
    transformers' ``Qwen2Config`` would read it). Raises ``ValueError`` for another model type."""
    import json
    from pathlib import Path

    from llmlab.model.hf import config_from_hf

    raw = json.loads((Path(path) / "config.json").read_text())
    if raw.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"model_type={raw.get('model_type')!r} is not {MODEL_TYPES}")
    text = dict(raw.get("text_config") or raw)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or raw.get("rope_scaling") or {})
    section = list(rope.pop("mrope_section", [16, 24, 24]))
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
        rope["rope_type"] = "default"
    rope.pop("type", None)
    rope.setdefault("rope_theta", text.get("rope_theta", raw.get("rope_theta", 1000000.0)))
    text.update(
        model_type="qwen2",
        rope_parameters=rope,
        rope_scaling=None,
        tie_word_embeddings=raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
        _name_or_path=str(path),
    )
    cfg = config_from_hf(types.SimpleNamespace(**text))
    mm = MultimodalConfig(
        VisionConfig.from_hf(raw["vision_config"], raw["model_type"]),
        int(raw["image_token_id"]),
        int(raw["vision_start_token_id"]),
        int(raw["vision_end_token_id"]),
        section,
    )
    return cfg, mm


def hf_key(name: str) -> str:
    """A checkpoint tensor's name in this model: transformers >= 4.52 writes
    ``model.language_model.*`` and ``model.visual.*``, older ones ``model.*`` and ``visual.*``."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.visual."):
        return name[len("model.") :]
    return name


def load_qwen2_5_vl(path: Any, dtype: torch.dtype = torch.float32) -> Qwen2_5_VLForConditionalGeneration:
    """Build the model from a local Hugging Face Qwen2.5-VL (or Qwen2-VL) checkpoint directory. Raises
    ``ValueError`` when tensors are missing or unexpected."""
    from llmlab.model.hf import load_into, load_state_dict

    cfg, mm = configs_from_hf(path)
    model = Qwen2_5_VLForConditionalGeneration(cfg, mm, seed=None)
    state = {hf_key(k): v for k, v in load_state_dict(path).items()}
    load_into(model, state, cfg.tie_word_embeddings, path, "Qwen2.5-VL")
    return model.to(dtype)
