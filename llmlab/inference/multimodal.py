"""Images as prompt tokens: what the engine keeps per request and feeds the model per step.

A request ``{"prompt_token_ids" or "prompt": ..., "multi_modal_data": {"image": [...]}}`` holds
one placeholder (the model's ``image_token_id``, ``<|image_pad|>``) per image; :func:`prepare`
decodes and processes each image (:mod:`llmlab.inference.image_processor`) and repeats its
placeholder once per image token, so from then on the image is ordinary prompt tokens: paged
K/V, chunked prefill (a chunk may end inside an image), preemption and recompute, all unchanged.

Per sequence, :class:`MultimodalState` keeps the images' patches, their spans in the prompt,
the prompt's M-RoPE position ids and the ``delta`` of the tokens after it. Per step,
:func:`step_inputs` gives the model the positions ``[3, N]`` of the step's tokens and the
embeddings of the image tokens among them: an image's encoder output is computed the first time
one of its tokens is scheduled and kept on the sequence until its last token is computed (so the
vision tower runs once per image even when the prefill is split; again only after a preemption
that drops the K/V). Prefix caching names a block by its tokens and, for each image it overlaps,
the image's content hash (:meth:`MultimodalState.block_key`): two prompts with the same image
share blocks; different images behind the same placeholder ids never do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from llmlab.inference.image_processor import (
    MAX_IMAGE_PIXELS,
    MAX_PIXELS,
    MIN_PIXELS,
    ImageError,
    ProcessedImage,
    load_image,
    process_image,
)
from llmlab.model.mrope import mrope_positions


@dataclass
class ImageSpan:
    """An image's tokens ``[offset, offset + image.num_tokens)`` of the prompt; ``embeds``
    ``[num_tokens, hidden]`` while its prefill is under way."""

    image: ProcessedImage
    offset: int
    embeds: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.offset + self.image.num_tokens


@dataclass
class MultimodalState:
    """A sequence's images, its prompt's position ids ``[3, prompt_len]`` and ``delta``."""

    spans: list[ImageSpan]
    positions: torch.Tensor
    delta: int
    encoder_runs: int = 0  # vision-tower calls so far (tests, metrics)
    _keys: dict[tuple[int, int], tuple[tuple[str, int], ...]] = field(default_factory=dict)

    @property
    def num_image_tokens(self) -> int:
        return sum(s.image.num_tokens for s in self.spans)

    def block_key(self, start: int, end: int) -> tuple[tuple[str, int], ...]:
        """What, besides its token ids, names the prompt block ``[start, end)`` for prefix
        caching: ``(content_hash, first image token in the block)`` of each image it overlaps."""
        key = (start, end)
        if key not in self._keys:
            self._keys[key] = tuple(
                (s.image.content_hash, max(start, s.offset) - s.offset)
                for s in self.spans
                if s.offset < end and s.end > start
            )
        return self._keys[key]


def prepare(
    ids: list[int],
    images: list[Any],
    mm_config: Any,
    *,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    limit: int | None = None,
) -> tuple[list[int], MultimodalState]:
    """Expand the prompt ``ids`` (one ``image_token_id`` per image) and process ``images``
    (PIL images, paths, bytes, or :class:`ProcessedImage`). Returns the expanded ids and the
    sequence's :class:`MultimodalState`.

    Raises ``ValueError`` (:class:`ImageError` for a bad image) when the model takes no images
    (``mm_config`` None), there are more images than ``limit``, or the placeholders and the
    images differ in number."""
    if mm_config is None:
        raise ValueError("this model is text-only: it takes no images (image_url parts / multi_modal_data)")
    if limit is not None and len(images) > limit:
        raise ValueError(f"{len(images)} images in one prompt are over the limit limit_mm_per_prompt={limit}")
    tok = mm_config.image_token_id
    n_slots = sum(1 for t in ids if t == tok)
    if n_slots != len(images):
        raise ValueError(
            f"the prompt has {n_slots} image placeholders (token {tok}, "
            f"<|image_pad|>) for {len(images)} images; put one per image"
        )
    v = mm_config.vision
    done = [
        im
        if isinstance(im, ProcessedImage)
        else process_image(
            load_image(im, max_image_pixels),
            min_pixels,
            max_pixels,
            v.patch_size,
            v.spatial_merge_size,
            v.temporal_patch_size,
        )
        for im in images
    ]
    out: list[int] = []
    spans = []
    it = iter(done)
    for t in ids:
        if t == tok:
            im = next(it)
            spans.append(ImageSpan(im, len(out)))
            out += [tok] * im.num_tokens
        else:
            out.append(t)
    positions, delta = mrope_positions(
        len(out), [(s.offset, s.image.grid_thw) for s in spans], v.spatial_merge_size
    )
    return out, MultimodalState(spans, positions, delta)


def _positions(seq: Any, c: int, n: int) -> torch.Tensor:
    """M-RoPE ids ``[3, n]`` of ``seq``'s tokens ``[c, c + n)``."""
    mm = seq.mm
    if mm is None:
        return torch.arange(c, c + n).expand(3, -1)
    L = mm.positions.shape[1]
    parts = []
    if c < L:
        parts.append(mm.positions[:, c : min(c + n, L)])
    if c + n > L:
        parts.append(torch.arange(max(c, L), c + n).expand(3, -1) + mm.delta)
    return torch.cat(parts, dim=1)


def _image_rows(
    model: Any, seq: Any, c: int, n: int, row0: int, rows: list[int], embeds: list[torch.Tensor]
) -> None:
    """Append the step's image-token rows of ``seq`` (tokens ``[c, c + n)`` at flat rows from
    ``row0``) and their embeddings, running the encoder for an image not yet encoded."""
    for s in seq.mm.spans:
        a, b = max(c, s.offset), min(c + n, s.end)
        if a >= b:
            continue
        if s.embeds is None:
            im = s.image
            s.embeds = model.encode_images(im.pixel_values, torch.tensor([im.grid_thw]))
            seq.mm.encoder_runs += 1
        rows.extend(range(row0 + a - c, row0 + b - c))
        embeds.append(s.embeds[a - s.offset : b - s.offset])


def step_inputs(model: Any, order: list[tuple[Any, int]], device: torch.device) -> dict[str, torch.Tensor]:
    """The model's extra inputs for a step computing ``n`` tokens of each ``(seq, n)`` of
    ``order`` (the flat batch's order), from each ``seq.num_computed_tokens``: ``positions
    [3, N]``, ``image_embeds [K, hidden]`` and ``image_mask [N]``. Encoder outputs of images whose
    last token is computed in this step are dropped from the sequence afterwards
    (:func:`release_done`)."""
    pos: list[torch.Tensor] = []
    rows: list[int] = []
    embeds: list[torch.Tensor] = []
    row = 0
    for seq, n in order:
        c = seq.num_computed_tokens
        pos.append(_positions(seq, c, n))
        if seq.mm is not None:
            _image_rows(model, seq, c, n, row, rows, embeds)
        row += n
    out = {"positions": torch.cat(pos, dim=1).to(device)}
    if rows:
        mask = torch.zeros(row, dtype=torch.bool)
        mask[rows] = True
        out["image_embeds"] = torch.cat(embeds).to(device)
        out["image_mask"] = mask.to(device)
    return out


def release_done(order: list[tuple[Any, int]]) -> None:
    """After a step: drop the encoder output of each image whose last token is now computed."""
    for seq, n in order:
        if seq.mm is not None:
            for s in seq.mm.spans:
                if s.embeds is not None and seq.num_computed_tokens + n >= s.end:
                    s.embeds = None


__all__ = ["ImageError", "ImageSpan", "MultimodalState", "prepare", "step_inputs", "release_done"]


def from_request(
    prompt: Any, ids: list[int], mm_config: Any, cfg: Any
) -> tuple[list[int], MultimodalState | None]:
    """The engine's hook: a ``multi_modal_state`` made by :func:`prepare` for these (expanded)
    ``ids``, or ``prompt``'s images (``multi_modal_data["image"]``: one image or a
    list) under the engine config ``cfg``'s pixel bounds and limits, overridden per request by
    ``mm_processor_kwargs`` (``min_pixels``, ``max_pixels``). Returns ``(ids, None)`` for a
    prompt without images. Raises ``ValueError`` as :func:`prepare`, and for unknown
    ``mm_processor_kwargs`` or modalities."""
    state = prompt.get("multi_modal_state") if isinstance(prompt, dict) else None
    if state is not None:  # already processed and expanded (the server)
        if (
            mm_config is None
            or not isinstance(state, MultimodalState)
            or sum(1 for t in ids if t == mm_config.image_token_id) != state.num_image_tokens
        ):
            raise ValueError("multi_modal_state does not match the prompt's image tokens")
        return ids, state
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    images = (data or {}).get("image")
    if data and set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: only 'image' is supported, not {sorted(set(data) - {'image'})}")
    if images is None:
        if mm_config is not None and mm_config.image_token_id in ids:
            raise ValueError(
                f"the prompt has image placeholders (token {mm_config.image_token_id}) but no images"
            )
        return ids, None
    if not isinstance(images, (list, tuple)):
        images = [images]
    kw = dict(prompt.get("mm_processor_kwargs") or {})
    bad = set(kw) - {"min_pixels", "max_pixels"}
    if bad:
        raise ValueError(f"mm_processor_kwargs: unknown keys {sorted(bad)} (min_pixels, max_pixels)")
    hi = int(kw.get("max_pixels", cfg.max_pixels))
    lo = int(kw.get("min_pixels", min(cfg.min_pixels, hi)))
    if hi > cfg.max_pixels:
        raise ValueError(
            f"mm_processor_kwargs max_pixels={hi} is over the engine's max_pixels={cfg.max_pixels}"
        )
    return prepare(
        ids,
        list(images),
        mm_config,
        min_pixels=lo,
        max_pixels=hi,
        max_image_pixels=cfg.max_image_pixels,
        limit=cfg.limit_mm_per_prompt,
    )
