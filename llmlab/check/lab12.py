"""Checks for the lab 12 exercises (:mod:`llmlab.solutions.lab12`), against llmlab's own
serving formulas (:mod:`llmlab.formulas.serving`)."""

from __future__ import annotations

import math
from typing import Callable

from llmlab.check._base import _fail, _ok
from llmlab.formulas import serving as F
from llmlab.solutions import lab12 as ex

# (name, layers, kv_heads, head_dim, bytes, tp): published shapes
_SHAPES = [
    ("Llama-3-8B bf16", 32, 8, 128, 2, 1),
    ("Qwen2.5-7B bf16", 28, 4, 128, 2, 1),
    ("Qwen2.5-72B bf16 TP8", 80, 8, 128, 2, 8),
    ("Llama-2-7B fp8 (MHA)", 32, 32, 128, 1, 1),
    ("Qwen2.5-72B fp32 TP2", 80, 8, 128, 4, 2),
]


def kv_bytes_per_token(fn: Callable) -> bool:
    name = "kv_bytes_per_token"
    for label, L, kv, hd, b, tp in _SHAPES:
        want, got = F.kv_bytes_per_token(L, kv, hd, b, tp), fn(L, kv, hd, b, tp)
        if not isinstance(got, (int, float)) or not math.isclose(got, want):
            ratio = got / want if isinstance(got, (int, float)) and want else None
            hint = (
                "half the answer: count K and V (the factor 2)"
                if ratio == 0.5
                else "tensor parallelism: each rank holds kv_heads / tp heads"
                if ratio == tp
                else "2 (K and V) x layers x (kv_heads / tp) x head_dim x bytes"
            )
            _fail(
                name,
                f"{label}: layers={L}, kv_heads={kv}, head_dim={hd}, bytes={b}, tp={tp}",
                want,
                got,
                hint,
            )
    return _ok(name, "KV bytes per token per GPU of five published shapes, GQA and TP included")


def kv_concurrency(fn: Callable) -> bool:
    name = "kv_concurrency"
    cases = [
        (53.7e9, 40960, 16, 10240),
        (1e6, 100, 16, 33),
        (1e6, 100, 16, 32),
        (16 * 100 * 3 - 1, 100, 16, 16),
        (0.0, 100, 16, 16),
        (-1e9, 100, 16, 16),
        (5e9, 57344, 8, 1000),
    ]
    for budget, bpt, bs, n in cases:
        want, got = ex.kv_concurrency(budget, bpt, bs, n), fn(budget, bpt, bs, n)
        if got != want:
            whole = int(max(budget, 0) // (bpt * n)) if budget > 0 else 0
            hint = (
                "no budget, no blocks: return 0"
                if budget <= 0
                else "count whole blocks: floor(budget / (bytes_per_token x block_size)) blocks, "
                "then ceil(seq_len / block_size) blocks per sequence"
                if got == whole
                else "blocks // ceil(seq_len / block_size): a sequence holds whole blocks"
            )
            _fail(
                name,
                f"budget={budget:g} B, bytes_per_token={bpt}, block_size={bs}, seq_len={n}",
                want,
                got,
                hint,
            )
    return _ok(name, "sequences in a paged pool, whole blocks, on seven budgets")


def decode_tpot(fn: Callable) -> bool:
    name = "decode_tpot"
    cases = [
        (16e9, 131072, 1, 512, 3.35e12),
        (16e9, 131072, 64, 4096, 3.35e12),
        (145e9 / 8, 40960, 128, 10240, 2.039e12),
        (1e6, 1000, 3, 7, 1e9),
    ]
    for w, kv, b, c, bw in cases:
        want, got = ex.decode_tpot(w, kv, b, c, bw), fn(w, kv, b, c, bw)
        if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-9):
            hint = (
                "the weights are read once per step, not once per sequence"
                if isinstance(got, (int, float)) and math.isclose(got, (b * w + b * c * kv) / bw)
                else "(weights + batch x context x kv_bytes_per_token) / bandwidth"
            )
            _fail(
                name,
                f"weights={w:g} B, kv/token={kv}, batch={b}, context={c}, bandwidth={bw:g}",
                want,
                got,
                hint,
            )
    return _ok(name, "the memory roofline of a decode step on four workloads")
