"""Lab 12 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations


def kv_bytes_per_token(
    num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: float, tp: int = 1
) -> float:
    """Lab 12. Bytes of KV cache one token takes on one GPU.

    Every layer stores a key and a value vector per KV head for each token: 2 (K and V) x
    ``num_layers`` x ``kv_heads`` x ``head_dim`` x ``dtype_bytes``. Under tensor parallelism each of
    the ``tp`` ranks holds ``kv_heads / tp`` of the heads (``tp`` divides ``kv_heads``). GQA models
    have fewer KV heads than query heads: use ``kv_heads``, not the attention heads.
    (llmlab.formulas.serving.kv_bytes_per_token; PagedAttention, Kwon et al. 2023, §2.3.)
    """
    return 2 * num_layers * (kv_heads // tp) * head_dim * dtype_bytes


def kv_concurrency(kv_budget_bytes: float, bytes_per_token: float, block_size: int, seq_len: int) -> int:
    """Lab 12. How many sequences of ``seq_len`` tokens a paged KV cache holds at once.

    The engine cuts its KV budget into whole blocks of ``block_size`` tokens:
    ``floor(kv_budget_bytes / (bytes_per_token x block_size))`` blocks (0 if the budget is not
    positive). A sequence holds whole blocks: ``ceil(seq_len / block_size)``. Return how many such
    sequences fit in the pool (vLLM's "Maximum concurrency for N tokens per request", counted in
    whole blocks).
    """
    if kv_budget_bytes <= 0:
        return 0
    blocks = int(kv_budget_bytes // (bytes_per_token * block_size))
    return blocks // -(-seq_len // block_size)


def decode_tpot(
    weight_bytes: float, kv_bytes_per_token: float, batch: int, context: int, hbm_bandwidth: float
) -> float:
    """Lab 12. The memory roofline of one decode step (seconds): the time per output token.

    A decode step computes one token for each of ``batch`` sequences. It reads every weight once
    (``weight_bytes``, shared by the batch) and, for each sequence, the K/V of its ``context``
    tokens (``kv_bytes_per_token`` each). Decoding is memory-bound: the step takes the bytes read
    over the ``hbm_bandwidth`` (bytes/s). Return that time.
    """
    return (weight_bytes + batch * context * kv_bytes_per_token) / hbm_bandwidth


EXERCISES = [kv_bytes_per_token, kv_concurrency, decode_tpot]
