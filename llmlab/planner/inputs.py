"""``llmlab plan``'s flags checked before any planning: each number finite and in its range, the
model's shape consistent, and each error naming the flag (``--peak-tflops must be > 0, got 0``).

Zero is an error wherever it means nothing (0 heads, 0 GB, 0 FLOP/s), never a stand-in for the
default: a flag not given is ``None``. The same constraints, for the Python API, are in
:meth:`llmlab.planner.specs.ModelSpec.validate`, :meth:`~llmlab.planner.specs.Workload.validate`
and :meth:`llmlab.planner.cluster.ClusterSpec.validate`.
"""
from __future__ import annotations

import argparse
import math

# argparse dest -> least value of a whole-number flag.
COUNT_FLAGS = {"num_layers": 1, "hidden_size": 1, "num_heads": 1, "num_kv_heads": 1,
               "vocab_size": 1, "num_gpus": 1, "gpus_per_node": 1, "seq_len": 1, "top": 1,
               "validate_layouts": 1, "validate_steps": 3}
# argparse dest -> whether 0 is allowed, for real-valued flags (> 0, or >= 0).
REAL_FLAGS = {"params": False, "gpu_memory_gb": False, "peak_tflops": False,
              "intra_bw_gb_s": False, "inter_bw_gb_s": False, "intra_latency_us": True,
              "inter_latency_us": True, "global_batch_tokens": False, "tokens": False}
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size")


def flag(dest: str) -> str:
    """``gpu_memory_gb`` -> ``--gpu-memory-gb``."""
    return "--" + dest.replace("_", "-")


def check_number(name: str, v: object, *, integer: bool = False, least: float = 0,
                 zero_ok: bool = False) -> None:
    """``ValueError`` naming ``name`` unless ``v`` is a finite number (an int if ``integer``) at
    least ``least`` (integers) or > 0 (>= 0 with ``zero_ok``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if integer:
        if not isinstance(v, int) or v < least:
            raise ValueError(f"{name} must be an integer >= {least:g}, got {v!r}")
    elif v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {v:g}")


def check_args(args: argparse.Namespace) -> None:
    """Every numeric flag of ``llmlab plan`` that was given, then the shape: ``--num-heads``
    divides ``--hidden-size``, ``--num-kv-heads`` divides ``--num-heads``, the shape flags go with
    ``--params``, ``--global-batch-tokens`` is a whole number. Raises ``ValueError``."""
    for dest, least in COUNT_FLAGS.items():
        if getattr(args, dest, None) is not None:
            check_number(flag(dest), getattr(args, dest), integer=True, least=least)
    for dest, zero_ok in REAL_FLAGS.items():
        if getattr(args, dest, None) is not None:
            check_number(flag(dest), getattr(args, dest), zero_ok=zero_ok)
    frac = getattr(args, "achievable_fraction", None)
    if frac is not None and not (isinstance(frac, (int, float)) and 0 < frac <= 1):   # NaN too
        raise ValueError(f"--achievable-fraction must be in (0, 1], got {frac!r}")
    if args.global_batch_tokens != int(args.global_batch_tokens):
        raise ValueError(f"--global-batch-tokens must be a whole number of tokens, got "
                         f"{args.global_batch_tokens:g}")
    given = [flag(d) for d in SHAPE_FLAGS if getattr(args, d, None) is not None]
    if given and args.params is None:
        raise ValueError(f"{', '.join(given)} {'go' if len(given) > 1 else 'goes'} with --params "
                         f"(--model and --config fix the shape)")
    hidden, heads, kv = args.hidden_size, args.num_heads, args.num_kv_heads
    if hidden is not None and heads is not None and hidden % heads:
        raise ValueError(f"--num-heads {heads} must divide --hidden-size {hidden}")
    if heads is not None and kv is not None and heads % kv:
        raise ValueError(f"--num-kv-heads {kv} must divide --num-heads {heads} (each key/value "
                         f"head serves a whole group of query heads)")
