"""Compute: FLOPs of training, and the ideal time to do them.

Training FLOPs ≈ 6·N·T (Kaplan et al. 2020, §2.1: 2 FLOPs per parameter per token forward, 4
backward). The source articles' 8B model on 2.5e11 tokens: 1.2e22 FLOPs, 3.85e7 s ≈ 445 days on
one 312 TFLOP/s GPU. The per-token count with attention is
:func:`training_flops_per_token` (it feeds the measured MFU, :mod:`llmlab.metrics.throughput`).
"""

from __future__ import annotations

from llmlab.formulas._checks import check_count


def training_flops(num_params: float, num_tokens: float) -> float:
    """Total training FLOPs ``6·N·T`` (forward 2N, backward 4N per token).

    Raises ``ValueError`` for a non-positive count. Source: Kaplan et al. 2020 ("Scaling Laws for
    Neural Language Models"), §2.1; attention's extra 12·L·h·s per token (PaLM, App. B) is left
    out, as in the source articles.
    """
    check_count("num_params", num_params)
    check_count("num_tokens", num_tokens)
    return 6.0 * num_params * num_tokens


def training_flops_per_token(num_params: float, num_layers: int, hidden: int, seq_len: int) -> float:
    """``6N + 12·L·h·T`` FLOPs to train on one token (forward + backward): the 6·N of the weights
    and attention's scores and weighted sum, 12·L·h·T (PaLM, Chowdhery et al. 2022, App. B)."""
    return 6.0 * num_params + 12.0 * num_layers * hidden * seq_len


def ideal_training_time_s(
    total_flops: float, peak_flops_per_s: float, num_gpus: int = 1, mfu: float = 1.0
) -> float:
    """Seconds to do ``total_flops`` on ``num_gpus`` devices at ``mfu`` × their peak FLOP/s.

    ``mfu=1`` is the ideal (the source articles' "theoretical minimum"); real runs reach 0.3-0.55
    (PaLM, Chowdhery et al. 2022, App. B). Raises ``ValueError`` for non-positive inputs or
    mfu > 1.
    """
    check_count("total_flops", total_flops)
    check_count("peak_flops_per_s", peak_flops_per_s)
    check_count("num_gpus", num_gpus)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    return total_flops / (peak_flops_per_s * num_gpus * mfu)


def block_flops(b: int, s: int, h: int, f: int, a: int, kv: int, t: int = 1) -> dict:
    """Per-rank FLOPs of one Llama block (GQA attention, SwiGLU MLP) under tensor parallelism t:
    ``{"forward", "backward", "total"}``.

    ``2·b·s·(weights' inputs × outputs)`` per matmul forward plus ``4·b·s²·h`` for the attention
    scores and values (causal masking not subtracted), all divided by ``t``; backward is twice
    the forward. Shapes: ``b`` sequences of ``s`` tokens, hidden ``h``, MLP width ``f``, ``a``
    query heads, ``kv`` key/value heads. Source: Megatron-LM (Narayanan et al. 2021, §5.1).
    """
    d = h // a
    weights = h * (a * d) + 2 * h * (kv * d) + (a * d) * h + 3 * h * f
    fwd = (2 * b * s * weights + 4 * b * s * s * h) / t
    return {"forward": fwd, "backward": 2 * fwd, "total": 3 * fwd}
