"""Multimodal rotary positions (M-RoPE, Qwen2-VL, Wang et al. 2024 §2.1): every token has three
position ids, temporal, height and width; the rotary frequencies are cut into ``mrope_section``
parts (``[16, 24, 24]`` of the 64 frequency pairs in Qwen2.5-VL-7B) that turn with one id each.

A text token has the same id three times (ordinary RoPE). The tokens of an image with a merged
grid ``gh x gw`` get ``(s, s + row, s + col)``, ``s`` the position the image starts at; the text
after it continues from ``s + max(gh, gw)``. So a sequence's last position is below its length
and every later token is at ``index + delta`` with ``delta = max position + 1 - length``
(Hugging Face's ``get_rope_index`` and ``rope_deltas``).
"""

from __future__ import annotations

import torch

from llmlab.model.llama import rotary_cos_sin


def mrope_positions(
    num_tokens: int, images: list[tuple[int, tuple[int, int, int]]], merge: int
) -> tuple[torch.Tensor, int]:
    """Position ids ``[3, num_tokens]`` int64 of a prompt and its ``delta``.

    ``images``: ``(offset, (t, h, w))`` of each image, in order: its tokens occupy
    ``[offset, offset + t*h*w / merge^2)`` of the prompt and ``(t, h, w)`` is its patch grid.
    Raises ``ValueError`` if images overlap or run past the prompt."""
    parts, pos, i = [], 0, 0
    for offset, (t, h, w) in images:
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if offset < i or offset + n > num_tokens:
            raise ValueError(
                f"image tokens [{offset}, {offset + n}) overlap or leave the prompt of {num_tokens} tokens"
            )
        parts.append(torch.arange(offset - i).expand(3, -1) + pos)
        pos += offset - i
        tt, hh, ww = torch.meshgrid(
            torch.zeros(t, dtype=torch.long), torch.arange(gh), torch.arange(gw), indexing="ij"
        )
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(gh, gw)
        i = offset + n
    parts.append(torch.arange(num_tokens - i).expand(3, -1) + pos)
    ids = torch.cat(parts, dim=1)
    return ids, int(ids.max()) + 1 - num_tokens if num_tokens else 0


def mrope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    section: list[int],
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[N, head_dim]`` for position ids ``[3, N]``: frequency pair ``j`` in the
    ``k``-th part of ``section`` turns with row ``k`` of ``positions`` (Hugging Face's
    ``Qwen2_5_VLRotaryEmbedding``). Raises ``ValueError`` if ``sum(section) != head_dim / 2``."""
    if sum(section) * 2 != head_dim:
        raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {head_dim // 2}")
    cos, sin = rotary_cos_sin(positions, head_dim, theta, torch.float32)  # [3, N, D]

    def pick(x: torch.Tensor) -> torch.Tensor:
        half = x[..., : head_dim // 2].split(list(section), dim=-1)
        f = torch.cat([m[i % 3] for i, m in enumerate(half)], dim=-1)
        return torch.cat([f, f], dim=-1).to(dtype)

    return pick(cos), pick(sin)
