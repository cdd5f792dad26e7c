"""The vision tower of Qwen2.5-VL: a ViT over 14x14 patches with 2D rotary positions, window and
full attention layers, and a merger that turns each 2x2 group of patches into one token of the
language model's width.

Qwen2.5-VL (Bai et al. 2025, §2.1): an image resized to a multiple of 28 pixels on each side is
cut into 14x14 patches (the temporal patch size 2 repeats a still image twice, so the same
patch embedding serves video); every block is pre-norm RMSNorm + attention + SwiGLU. Most blocks
attend inside windows of ``window_size`` pixels (``window_size // 28`` merged tokens a side), the
blocks in ``fullatt_block_indexes`` over the whole image. The patches of one 2x2 merge unit are
consecutive (the processor's order), so the merger is a norm, a reshape to ``4 * width`` and an
MLP. Parameter names are Hugging Face's (``visual.blocks.0.attn.qkv.weight`` ...), so a
checkpoint's tensors load with ``load_state_dict``.

Shapes: ``P`` patches (all images together), ``C`` vision width, ``grid_thw [I, 3]`` each image's
(temporal, height, width) patch grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmlab.model.layers import RMSNorm
from llmlab.model.llama import rotate_half


@dataclass
class VisionConfig:
    """Hugging Face's ``Qwen2_5_VLVisionConfig`` fields that change the maths."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    out_hidden_size: int = 3584
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = field(default=(7, 15, 23, 31))
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    variant: str = "qwen2_5_vl"  # "qwen2_vl": LayerNorm, fc1/fc2 MLP, full attention only

    @classmethod
    def from_hf(cls, vc: Any, model_type: str = "qwen2_5_vl") -> "VisionConfig":
        """From a ``transformers`` vision config (object or dict) of ``model_type``
        (``qwen2_5_vl`` or ``qwen2_vl``). Raises ``ValueError`` for an activation other than
        silu (Qwen2.5-VL) or quick_gelu/gelu (Qwen2-VL)."""
        get: Any = vc.get if isinstance(vc, dict) else (lambda k, d=None: getattr(vc, k, d))
        rope = get("rope_parameters") or {}
        if model_type == "qwen2_vl":
            width, depth = get("embed_dim"), get("depth")
            cfg = cls(
                depth=depth,
                hidden_size=width,
                intermediate_size=int(width * get("mlp_ratio", 4)),
                num_heads=get("num_heads"),
                out_hidden_size=get("hidden_size"),
                in_channels=get("in_channels", 3),
                patch_size=get("patch_size", 14),
                temporal_patch_size=get("temporal_patch_size", 2),
                spatial_merge_size=get("spatial_merge_size", 2),
                fullatt_block_indexes=tuple(range(depth)),
                rope_theta=float(rope.get("rope_theta", 10000.0)),
                hidden_act=get("hidden_act", "quick_gelu"),
                variant="qwen2_vl",
            )
            if cfg.hidden_act not in ("quick_gelu", "gelu"):
                raise ValueError(f"vision hidden_act={cfg.hidden_act!r} is not supported (quick_gelu, gelu)")
            return cfg
        cfg = cls(
            depth=get("depth"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_heads=get("num_heads"),
            out_hidden_size=get("out_hidden_size"),
            in_channels=get("in_channels", 3),
            patch_size=get("patch_size", 14),
            temporal_patch_size=get("temporal_patch_size", 2),
            spatial_merge_size=get("spatial_merge_size", 2),
            window_size=get("window_size", 112),
            fullatt_block_indexes=tuple(get("fullatt_block_indexes") or ()),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            hidden_act=get("hidden_act", "silu"),
        )
        if cfg.hidden_act != "silu":
            raise ValueError(f"vision hidden_act={cfg.hidden_act!r} is not supported (silu)")
        return cfg

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x temporal x patch x patch (1176 for 3x2x14x14)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def vision_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """Each patch's (row, column) in its image, ``[P, 2]``, in the processor's patch order
    (merge-unit major: the ``merge x merge`` patches of one output token are consecutive)."""
    out = []
    for t, h, w in grid_thw.tolist():
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hh, ww = (x.reshape(shape).transpose(1, 2).flatten() for x in (hh, ww))
        out.append(torch.stack([hh, ww], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_index(
    grid_thw: torch.Tensor, merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, list[int]]:
    """The permutation of merge units that makes each attention window contiguous, and the
    windows' cumulative lengths in patches (``[0, ..., P]``), as Hugging Face's
    ``get_vision_window_index``: windows of ``window_size // merge // patch_size`` merge units a
    side tile each image from its top-left corner (the last row/column of windows may be short)."""
    win = window_size // merge // patch_size
    index, cu, base = [], [0], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = win - gh % win, win - gw % win
        nh, nw = (gh + ph) // win, (gw + pw) // win
        pad = F.pad(idx, (0, pw, 0, ph), value=-100).reshape(t, nh, win, nw, win)
        pad = pad.permute(0, 1, 3, 2, 4).reshape(t, nh * nw, win, win)
        lens = (pad != -100).sum([2, 3]).reshape(-1)
        flat = pad.reshape(-1)
        index.append(flat[flat != -100] + base)
        for n in lens.tolist():
            if n:
                cu.append(cu[-1] + n * merge * merge)
        base += t * gh * gw
    return torch.cat(index), cu


class VisionAttention(nn.Module):
    """Bidirectional attention within segments: ``x [P, C]``, rotary tables ``[P, Dh]``,
    ``cu [S+1]`` segment boundaries (windows or whole images) -> ``[P, C]``."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: list[int]) -> torch.Tensor:
        P, C = x.shape
        q, k, v = self.qkv(x).reshape(P, 3, self.num_heads, -1).unbind(1)  # [P, H, Dh]
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        return self.proj(segment_attention(q, k, v, cu).reshape(P, C))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Bidirectional attention of ``q, k, v [P, H, Dh]`` within each segment ``[cu[i],
    cu[i+1])``; segments of equal length (most windows) run as one batched call."""
    out = torch.empty_like(q)
    by_len: dict[int, list[int]] = {}
    for a, b in zip(cu[:-1], cu[1:]):
        by_len.setdefault(b - a, []).append(a)
    for L, starts in by_len.items():
        rows = (torch.tensor(starts)[:, None] + torch.arange(L)).flatten().to(q.device)
        n, H, D = len(starts), q.shape[1], q.shape[2]
        qs, ks, vs = (t[rows].view(n, L, H, D).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)  # [n, H, L, Dh]
        out[rows] = o.transpose(1, 2).reshape(n * L, H, D)
    return out


class VisionMLP(nn.Module):
    """SwiGLU with biases (the vision blocks' feed-forward)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QuickGELUMLP(nn.Module):
    """Qwen2-VL's vision feed-forward: ``fc2(act(fc1(x)))``, act quick_gelu
    (``x * sigmoid(1.702 x)``) or gelu."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.quick = act == "quick_gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h) if self.quick else F.gelu(h))


def vision_norm(cfg: VisionConfig) -> nn.Module:
    """RMSNorm (Qwen2.5-VL) or LayerNorm (Qwen2-VL), eps 1e-6."""
    return (
        nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        if cfg.variant == "qwen2_vl"
        else RMSNorm(cfg.hidden_size, 1e-6)
    )


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = vision_norm(cfg)
        self.norm2 = vision_norm(cfg)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = (
            QuickGELUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
            if cfg.variant == "qwen2_vl"
            else VisionMLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A 3D convolution with stride = kernel (2x14x14): each patch's ``patch_dim`` values -> ``C``."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        x = x.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, c.hidden_size)


class PatchMerger(nn.Module):
    """RMSNorm (LayerNorm in Qwen2-VL), then each ``merge^2`` consecutive patches concatenated and an MLP (GELU) to the
    language model's width: ``[P, C] -> [P / merge^2, out_hidden_size]``."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = vision_norm(cfg)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    """``forward(pixel_values [P, patch_dim], grid_thw [I, 3]) -> [P / merge^2, out_hidden_size]``:
    the image tokens of all images, in order (image ``i`` gives ``t*h*w / merge^2`` rows)."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        spatial = head_dim // 2
        self.register_buffer(
            "inv_freq",
            1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)),
            persistent=False,
        )

    def rotary(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2D rotary tables ``[P, Dh]``: a quarter of the frequencies turn with the row, a quarter
        with the column, repeated for the two halves ``rotate_half`` pairs."""
        pos = vision_positions(grid_thw, self.cfg.spatial_merge_size).to(self.inv_freq.device)
        f = pos[..., None].float() * self.inv_freq  # [P, 2, Dh/4]
        f = torch.cat([f[:, 0], f[:, 1]], dim=-1)
        f = torch.cat([f, f], dim=-1)
        return f.cos(), f.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        unit = c.spatial_merge_size**2
        grid_thw = grid_thw.cpu()
        if c.variant == "qwen2_vl":  # no windows: every block sees the image
            return self._full(pixel_values, grid_thw)
        order, cu_win = window_index(grid_thw, c.spatial_merge_size, c.window_size, c.patch_size)
        seg = (grid_thw[:, 1] * grid_thw[:, 2]).repeat_interleave(grid_thw[:, 0])
        cu_full = [0] + seg.cumsum(0).tolist()
        x = self.patch_embed(pixel_values)
        P = x.shape[0]

        def permute(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(P // unit, unit, -1)[order.to(t.device)].reshape(P, -1)

        x = permute(x)
        cos, sin = (permute(t) for t in self.rotary(grid_thw))
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, cu_full if i in c.fullatt_block_indexes else cu_win)
        return self.merger(x)[torch.argsort(order).to(x.device)]

    def _full(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Qwen2-VL: every block attends over each whole image, in the processor's order."""
        seg = (grid_thw[:, 1] * grid_thw[:, 2]).repeat_interleave(grid_thw[:, 0])
        cu = [0] + seg.cumsum(0).tolist()
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grid_thw)
        for blk in self.blocks:
            x = blk(x, cos, sin, cu)
        return self.merger(x)
