"""``llmlab plan``'s flags checked before any planning: each number finite and in its range, the
model's shape consistent, and each error naming the flag (``--peak-tflops must be > 0, got 0``).

Zero is an error wherever it means nothing (0 heads, 0 GB, 0 FLOP/s), never a stand-in for the
default: a flag not given is ``None``. The same constraints, for the Python API, are in
:meth:`llmlab.planner.specs.ModelSpec.validate`, :meth:`~llmlab.planner.specs.Workload.validate`
and :meth:`llmlab.planner.cluster.ClusterSpec.validate`.
"""

from __future__ import annotations

import argparse

from llmlab.formulas._checks import check_flag

# argparse dest -> (least, most) of a whole-number flag (the search enumerates the divisors of
# --num-gpus: a million GPUs take seconds, more would take minutes).
COUNT_FLAGS = {
    "num_layers": (1, 10**6),
    "hidden_size": (1, 10**7),
    "num_heads": (1, 10**6),
    "num_kv_heads": (1, 10**6),
    "vocab_size": (1, 10**9),
    "num_gpus": (1, 2**20),
    "gpus_per_node": (1, 2**20),
    "seq_len": (1, 10**9),
    "top": (1, 10**6),
    "validate_layouts": (1, 10**3),
    "validate_steps": (3, 10**6),
}
# argparse dest -> whether 0 is allowed, for real-valued flags (> 0, or >= 0).
REAL_FLAGS = {
    "params": False,
    "gpu_memory_gb": False,
    "peak_tflops": False,
    "intra_bw_gb_s": False,
    "inter_bw_gb_s": False,
    "intra_latency_us": True,
    "inter_latency_us": True,
    "global_batch_tokens": False,
    "tokens": False,
}
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size")


def flag(dest: str) -> str:
    """``gpu_memory_gb`` -> ``--gpu-memory-gb``."""
    return "--" + dest.replace("_", "-")


def check_args(args: argparse.Namespace) -> None:
    """Every numeric flag of ``llmlab plan`` that was given, then the shape: ``--num-heads``
    divides ``--hidden-size``, ``--num-kv-heads`` divides ``--num-heads``, the shape flags go with
    ``--params``, ``--global-batch-tokens`` is a whole number. Raises ``ValueError``."""
    for dest, (least, most) in COUNT_FLAGS.items():
        if getattr(args, dest, None) is not None:
            check_flag(flag(dest), getattr(args, dest), integer=True, least=least, most=most)
    for dest, zero_ok in REAL_FLAGS.items():
        if getattr(args, dest, None) is not None:
            check_flag(flag(dest), getattr(args, dest), zero_ok=zero_ok)
    frac = getattr(args, "achievable_fraction", None)
    if frac is not None:
        check_flag("--achievable-fraction", frac, most=1.0)  # a share of the peak: (0, 1]
    if args.global_batch_tokens != int(args.global_batch_tokens):
        raise ValueError(
            f"--global-batch-tokens must be a whole number of tokens, got {args.global_batch_tokens:g}"
        )
    given = [flag(d) for d in SHAPE_FLAGS if getattr(args, d, None) is not None]
    if given and args.params is None:
        raise ValueError(
            f"{', '.join(given)} {'go' if len(given) > 1 else 'goes'} with --params "
            f"(--model and --config fix the shape)"
        )
    hidden, heads, kv = args.hidden_size, args.num_heads, args.num_kv_heads
    if hidden is not None and heads is not None and hidden % heads:
        raise ValueError(f"--num-heads {heads} must divide --hidden-size {hidden}")
    if heads is not None and kv is not None and heads % kv:
        raise ValueError(
            f"--num-kv-heads {kv} must divide --num-heads {heads} (each key/value "
            f"head serves a whole group of query heads)"
        )
