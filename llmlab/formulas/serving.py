"""Serving costs: the KV cache, how many requests fit, and the time of a prefill and a decode step.

Units: bytes, tokens, seconds, FLOP/s. Sources:

* KV cache per token: 2 (K and V) x layers x kv_heads x head_dim x bytes (PagedAttention, Kwon et
  al. SOSP 2023, §2.3; GQA, Ainslie et al. 2023, divides it by heads / kv_heads). Tensor
  parallelism splits the KV heads over its ranks, pipeline parallelism the layers.
* The pool (vLLM's ``determine_num_available_blocks``): the memory vLLM may use
  (``gpu_memory_utilization`` x the GPU's) less the weights and the peak activations of a profile
  forward pass, cut into blocks of ``block_size`` tokens; a sequence holds ceil(tokens /
  block_size) blocks, so ``num_blocks // ceil(max_model_len / block_size)`` sequences of
  ``max_model_len`` fit at once (vLLM prints ``num_blocks * block_size / max_model_len``, the same
  number without the last block's rounding).
* Decode is memory-bound (the roofline, Williams et al. 2009): a step reads every weight once and
  every sequence's K/V once, so its time is max(bytes / HBM bandwidth, FLOPs / FLOP/s); prefill is
  compute-bound: 2·N FLOPs per token plus attention's 4·L·s·h·s/2 (causal).
* Contiguous KV (one ``max_model_len`` reservation per request, as before PagedAttention) against
  paged (whole blocks of the tokens held): :func:`paged_vs_contiguous`.

Plain arithmetic, no torch (the package's bottom layer).
"""

from __future__ import annotations

import math

from llmlab.formulas._checks import check_count, check_ranks

# Bytes per element of weights / KV entries. int4 (AWQ/GPTQ) packs two weights per byte; the
# per-group scales (about 1/64 more) are not counted.
SERVE_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def serve_dtype_bytes(dtype: str, what: str = "--weight-dtype") -> float:
    """Bytes per element of a serving dtype; ``ValueError`` naming ``what`` for an unknown one."""
    if dtype not in SERVE_DTYPE_BYTES:
        raise ValueError(f"{what} {dtype!r}: expected one of {', '.join(SERVE_DTYPE_BYTES)}")
    return SERVE_DTYPE_BYTES[dtype]


def kv_bytes_per_token(
    num_layers: int, kv_heads: int, head_dim: int, kv_bytes: float, tp: int = 1, pp: int = 1
) -> float:
    """KV-cache bytes one token takes on one GPU: 2 x (layers / pp) x (kv_heads / tp) x head_dim x
    bytes. ``ValueError`` when ``tp`` does not divide ``kv_heads`` (each rank must hold whole KV
    heads, as vLLM's and llmlab's tensor-parallel attention require) or a count is not positive.
    With ``pp`` not dividing the layers, the busiest stage (ceil) is counted."""
    for name, v in (
        ("num_layers", num_layers),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("kv_bytes", kv_bytes),
    ):
        check_count(name, v)
    check_ranks(tp, "tp")
    check_ranks(pp, "pp")
    if kv_heads % tp:
        raise ValueError(f"tp={tp} does not divide the model's {kv_heads} KV heads")
    return 2 * math.ceil(num_layers / pp) * (kv_heads // tp) * head_dim * kv_bytes


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``num_tokens`` tokens holds: ceil(tokens / block_size)."""
    check_ranks(block_size, "block_size")
    return -(-int(num_tokens) // block_size)


def kv_pool_blocks(kv_budget_bytes: float, bytes_per_token: float, block_size: int) -> int:
    """Blocks that fit in ``kv_budget_bytes`` (0 when the budget is not positive):
    floor(budget / (bytes_per_token x block_size)), as vLLM and llmlab's engine cut their pool."""
    check_count("bytes_per_token", bytes_per_token)
    check_ranks(block_size, "block_size")
    if kv_budget_bytes <= 0:
        return 0
    return int(kv_budget_bytes // (bytes_per_token * block_size))


def max_concurrency(num_blocks: int, block_size: int, seq_tokens: int) -> int:
    """Sequences of ``seq_tokens`` tokens that hold their blocks at once in ``num_blocks``."""
    return int(num_blocks) // blocks_for(seq_tokens, block_size)


def profile_activation_bytes(
    num_tokens: int, hidden: int, ffn: int, vocab: int, act_bytes: float, tp: int = 1, max_num_seqs: int = 256
) -> float:
    """Peak activations of vLLM's profile forward of ``num_tokens`` tokens (its
    ``max_num_batched_tokens``) on one GPU: the MLP's gate and up outputs (2·ffn/tp) plus four
    hidden-size tensors (residual, normed input, attention output, MLP output) per token, and the
    fp32 logits of ``max_num_seqs`` sampled rows. An estimate: vLLM measures it in a profile run."""
    per_token = (2 * ffn / tp + 4 * hidden) * act_bytes
    return num_tokens * per_token + max_num_seqs * vocab * 4


def decode_step_time(
    weight_bytes: float,
    kv_read_bytes: float,
    flops: float,
    hbm_bandwidth: float,
    flop_rate: float,
    comm_s: float = 0.0,
) -> float:
    """Seconds of one decode step on one GPU: the roofline max(bytes read / HBM bandwidth,
    FLOPs / FLOP/s) plus the collectives that cannot overlap (``comm_s``). ``weight_bytes``: the
    GPU's weights (all read once per step); ``kv_read_bytes``: the K/V of every running sequence's
    context on this GPU."""
    check_count("hbm_bandwidth", hbm_bandwidth)
    check_count("flop_rate", flop_rate)
    return max((weight_bytes + kv_read_bytes) / hbm_bandwidth, flops / flop_rate) + comm_s


def decode_flops(
    active_params: float, batch: float, context_tokens: float, num_layers: int, hidden: int
) -> float:
    """FLOPs of one decode step of ``batch`` sequences: 2·N per token for the weights plus the
    attention's 4·layers·hidden per token of context (q·k and p·v), summed over the batch
    (``context_tokens``: the sum of the sequences' context lengths)."""
    return 2 * active_params * batch + 4 * num_layers * hidden * context_tokens


def prefill_flops(active_params: float, prompt_len: int, num_layers: int, hidden: int) -> float:
    """FLOPs of one prompt's prefill: 2·N per token plus causal attention 2·layers·hidden·s²
    (q·k and p·v over half the s x s scores)."""
    return 2 * active_params * prompt_len + 2 * num_layers * hidden * prompt_len**2


def gpus_for_bytes(total_bytes: float, gpu_memory_bytes: float, usable_fraction: float = 1.0) -> int:
    """The fewest GPUs of ``gpu_memory_bytes`` (using ``usable_fraction`` of each) that hold
    ``total_bytes``: ceil(bytes / (memory x fraction)). ``ValueError`` for non-positive memory."""
    check_count("gpu_memory_bytes", gpu_memory_bytes)
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction}")
    return math.ceil(total_bytes / (gpu_memory_bytes * usable_fraction))


def paged_vs_contiguous(
    lengths: list[int],
    reserve_len: int,
    bytes_per_token: float,
    block_size: int = 16,
    weight_bytes: float = 0.0,
) -> dict:
    """KV memory of a batch of requests with ``lengths`` tokens each, stored contiguously (each
    request reserves ``reserve_len`` slots, what systems before PagedAttention did for the longest
    output it might produce) or paged (each holds ceil(length / block_size) blocks).

    Returns ``{"contiguous_bytes", "paged_bytes", "contiguous_utilisation",
    "paged_utilisation", "utilisation_gain", "kv_ratio", "total_ratio"}``: utilisation = tokens
    stored / slots reserved; ``utilisation_gain`` = paged / contiguous utilisation - 1 (3.0 is
    "+300%"); ``kv_ratio`` and ``total_ratio`` = paged / contiguous bytes, of the KV alone and of
    weights (``weight_bytes``) + KV. Source: PagedAttention (Kwon et al. 2023), §3 and Fig. 2.
    """
    if not lengths or min(lengths) < 1 or max(lengths) > reserve_len:
        raise ValueError(f"lengths must be in [1, reserve_len={reserve_len}]")
    used = sum(lengths)
    contiguous = len(lengths) * reserve_len
    paged = sum(blocks_for(n, block_size) for n in lengths) * block_size
    cu, pu = used / contiguous, used / paged
    return {
        "contiguous_bytes": contiguous * bytes_per_token,
        "paged_bytes": paged * bytes_per_token,
        "contiguous_utilisation": cu,
        "paged_utilisation": pu,
        "utilisation_gain": pu / cu - 1,
        "kv_ratio": paged / contiguous,
        "total_ratio": (weight_bytes + paged * bytes_per_token)
        / (weight_bytes + contiguous * bytes_per_token),
    }
