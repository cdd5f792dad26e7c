"""Checks for the lab 15 exercise (:mod:`llmlab.solutions.lab15`), against llmlab's LoRA layer
(:class:`llmlab.model.lora.LoRALinear`): the merged weight must compute what the layer computes."""

from __future__ import annotations

from typing import Callable

import torch

from llmlab.check._base import _fail, _ok
from llmlab.model.lora import LoRALinear

# (out, in, rank, alpha): a square attention projection, a wide MLP one, rank 1, alpha == rank
_SHAPES = [(12, 12, 4, 8.0), (24, 10, 2, 16.0), (7, 9, 1, 1.0), (10, 16, 8, 8.0)]


def _layer(out: int, inp: int, rank: int, alpha: float, seed: int) -> LoRALinear:
    g = torch.Generator().manual_seed(seed)
    layer = LoRALinear(torch.nn.Linear(inp, out, bias=False), rank, alpha)
    with torch.no_grad():
        for p in (layer.weight, layer.lora_A.weight, layer.lora_B.weight):
            p.copy_(torch.randn(p.shape, generator=g))
    return layer


def _hint(got: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> str:
    r = a.shape[0]

    def close(t: torch.Tensor) -> bool:
        return torch.allclose(got, t, atol=1e-4, rtol=1e-4)

    if close(w + b @ a):
        return "the update is scaled: multiply B A by alpha / r (r: the rank, the rows of lora_A)"
    if close(w + alpha * r * (b @ a)) or close(w + r / alpha * (b @ a)):
        return "the scale is alpha / r: alpha divided by the rank"
    if close(b @ a * alpha / r):
        return "add the update to the base weight W: W + (alpha / r) B A"
    return "W + (alpha / r) B A: B [out, r] times A [r, in] gives the [out, in] update"


def merge_lora(fn: Callable) -> bool:
    name = "merge_lora"
    for seed, (out, inp, rank, alpha) in enumerate(_SHAPES):
        layer = _layer(out, inp, rank, alpha, seed)
        w, a, b = (t.detach().clone() for t in (layer.weight, layer.lora_A.weight, layer.lora_B.weight))
        what = f"W [{out}, {inp}], A [{rank}, {inp}], B [{out}, {rank}], alpha {alpha}"
        got = fn(w, a, b, alpha)
        if not torch.equal(w, layer.weight):
            _fail(
                name,
                f"{what}: the base weight was changed",
                "W unchanged",
                "W modified in place",
                "return a new tensor (weight + ...), not weight += ...: the base serves other adapters",
            )
        if not isinstance(got, torch.Tensor) or got.shape != w.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            _fail(
                name,
                f"{what}: the merged weight's shape",
                (out, inp),
                shape,
                "B [out, r] @ A [r, in] is [out, in], the base weight's shape",
            )
        x = torch.randn(5, inp, generator=torch.Generator().manual_seed(100 + seed))
        with torch.no_grad():
            want = layer(x)
        if not torch.allclose(x @ got.t(), want, atol=1e-4, rtol=1e-4):
            _fail(
                name,
                f"{what}: x @ merged^T against the LoRA layer's output",
                want,
                x @ got.t(),
                _hint(got, w, a, b, alpha),
            )
    return _ok(name, "the merged weight computes the LoRA layer's output on four shapes and scales")
