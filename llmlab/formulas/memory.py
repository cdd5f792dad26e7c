"""Memory of model states: parameters, gradients and optimizer states, unsharded and under ZeRO.

For Ψ parameters (ZeRO, Rajbhandari et al. 2020, §3.1 and §5, Figure 1):

* ``dtype="fp32"`` (everything in fp32): parameters 4Ψ, gradients 4Ψ, Adam's two moments 8Ψ.
  The source articles' 8B example: 32 GB + 32 GB + 64 GB.
* ``dtype="bf16"``/``"fp16"`` (mixed precision, ZeRO §3.1): 16-bit parameters 2Ψ and gradients
  2Ψ, plus an fp32 master copy 4Ψ and fp32 Adam moments 8Ψ, so K = 12: (2 + 2 + 12)Ψ = 16Ψ.
* ZeRO over N data-parallel ranks shards stage 1 the optimizer states, stage 2 also the
  gradients, stage 3 also the parameters.

Activations are in :mod:`llmlab.formulas.activations`.
"""

from __future__ import annotations

import math

from llmlab.formulas._checks import check_count, check_ranks, check_stage

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Optimizer state tensors per parameter, each the size of the parameter (kept in fp32).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "momentum": 1, "sgd": 0}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``"fp32"``, ``"bf16"`` or ``"fp16"``; ``ValueError`` otherwise."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def model_state_bytes(num_params: float, dtype: str = "fp32", optimizer: str = "adam") -> dict:
    """Bytes of parameters, gradients and optimizer states of one unsharded replica.

    Args:
        num_params: Ψ, the number of parameters (> 0).
        dtype: ``"fp32"`` (parameters, gradients and states all fp32) or ``"bf16"``/``"fp16"``
            (mixed precision: 16-bit parameters and gradients, fp32 master weights and states).
        optimizer: ``"adam"``/``"adamw"`` (two moments), ``"momentum"`` (SGD with momentum, one
            buffer) or ``"sgd"`` (no state).

    Returns:
        ``{"params", "grads", "optimizer_states", "total"}`` in bytes (ints). Optimizer-step
        counters (a few bytes per tensor in PyTorch) are not counted.

    Raises:
        ValueError: ``num_params`` not positive, unknown ``dtype`` or ``optimizer``.

    Source: ZeRO (Rajbhandari et al. 2020), §3.1: mixed-precision Adam needs 2Ψ + 2Ψ + KΨ with
    K = 12 (fp32 master copy, momentum, variance); in fp32 the master copy is the parameters.
    """
    check_count("num_params", num_params)
    b = dtype_bytes(dtype)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATES)}")
    master = 0 if dtype == "fp32" else 4  # fp32 master weights in mixed precision
    k = master + 4 * OPTIMIZER_STATES[optimizer]
    out = {
        "params": round(b * num_params),
        "grads": round(b * num_params),
        "optimizer_states": round(k * num_params),
    }
    out["total"] = sum(out.values())
    return out


def zero_model_state_bytes(
    num_params: float, stage: int, dp: int, dtype: str = "fp32", optimizer: str = "adam"
) -> dict:
    """Per-rank bytes of model states under ZeRO stage ``stage`` on ``dp`` data-parallel ranks.

    With P, G, O the unsharded bytes of :func:`model_state_bytes`:
    stage 0 (plain DDP) P + G + O; stage 1 P + G + O/N; stage 2 P + (G + O)/N; stage 3
    (P + G + O)/N. A sharded category holds ceil(Ψ/N) elements per rank (the flat, padded shard
    a real implementation keeps), so sizes are exact bytes, not rounded averages.

    Returns:
        ``{"params", "grads", "optimizer_states", "total"}`` bytes on one rank.

    Raises:
        ValueError: ``stage`` not in 0..3, ``dp`` < 1, or as :func:`model_state_bytes`.

    Source: ZeRO (Rajbhandari et al. 2020), §5 and Figure 1 (7.5B, N = 64, mixed-precision Adam:
    120 GB, 31.4 GB, 16.6 GB, 1.9 GB).
    """
    check_stage(stage)
    check_ranks(dp)
    full = model_state_bytes(num_params, dtype, optimizer)
    shard_elems = math.ceil(num_params / dp)
    sharded = {"params": stage >= 3, "grads": stage >= 2, "optimizer_states": stage >= 1}
    out = {
        cat: round(full[cat] / num_params * shard_elems) if is_sharded else full[cat]
        for cat, is_sharded in sharded.items()
    }
    out["total"] = sum(out.values())
    return out
