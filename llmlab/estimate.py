"""The three walls of training a large model, as calculators: memory, compute, communication.

Units: bytes, FLOPs, seconds. The printed table uses GB = 1e9 bytes (decimal, as the seed
document and the ZeRO paper do; 1 GiB = 1.074 GB).

Memory wall (model states, ZeRO, Rajbhandari et al. 2020, §3.1 and §5, Figure 1). For Ψ
parameters and optimizer state of K bytes per parameter:

* ``dtype="fp32"`` (everything in fp32): parameters 4Ψ, gradients 4Ψ, Adam's two moments 8Ψ.
  The seed's 8B example: 32 GB + 32 GB + 64 GB.
* ``dtype="bf16"``/``"fp16"`` (mixed precision, ZeRO §3.1): 16-bit parameters 2Ψ and gradients
  2Ψ, plus an fp32 master copy 4Ψ and fp32 Adam moments 8Ψ, so K = 12: (2 + 2 + 12)Ψ = 16Ψ.
* ZeRO shards over N data-parallel ranks: stage 1 the optimizer states, stage 2 also the
  gradients, stage 3 also the parameters (:func:`zero_model_state_bytes`).
* Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", §4, eqs. 1-3): :func:`activation_bytes_per_layer`.

Compute wall: training FLOPs ≈ 6·N·T (Kaplan et al. 2020, §2.1: 2 FLOPs per parameter per token
forward, 4 backward); the ideal time divides by the peak FLOP/s (:func:`training_flops`,
:func:`ideal_training_time_s`). The seed's 8B model on 2.5e11 tokens: 1.2e22 FLOPs, 3.85e7 s
≈ 445 days on one 312 TFLOP/s GPU.

Communication wall (:func:`communication_wall`). A ring all-reduce of B bytes sends, per rank,
2(N-1)/N·B bytes (a reduce-scatter then an all-gather), which tends to 2B for large N. The seed
(§2.3) counts 112 GB per step (32 GB of fp32 gradients + 80 GB of activations), pushes it through
the all-reduce factor 2 at 64 GB/s: 2 × 112 GB / 64 GB/s = 3.5 s per step; 2.5e11 tokens at a
global batch of 4M tokens is 62,500 steps, so 62,500 × 3.5 s = 218,750 s ≈ 60.76 hours. (The
seed calls 64 GB/s "InfiniBand HDR"; one HDR port carries 200 Gbit/s = 25 GB/s, so read it as the
node's aggregate bandwidth.) Per-step volume of DDP and ZeRO (ZeRO §7): 2Ψ for DDP and ZeRO-1/2
(reduce-scatter + all-gather), 3Ψ for ZeRO-3 (parameters all-gathered in forward and again in
backward, gradients reduce-scattered): :func:`zero_comm_bytes_per_step`.

Command line: ``llmlab estimate --params 8e9 --dtype fp32 --optimizer adam --tokens 2.5e11
--gpu-tflops 312 --num-gpus 1 [--zero S --dp N] [--tokens-per-step 4e6 --bandwidth-gb-s 64
--activation-comm-bytes 80e9] [--seq-len S --cp N] [--json PATH]``; with ``--cp N`` the
activation memory is per context-parallel rank (:func:`activation_bytes_per_rank`).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

GB = 1e9  # bytes; decimal, as the seed document and the ZeRO paper use
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Optimizer state tensors per parameter, each the size of the parameter (kept in fp32).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "momentum": 1, "sgd": 0}
SECONDS_PER_DAY = 86400.0


def _check_count(name: str, value, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return value


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _check_dp(dp) -> int:
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp (data-parallel degree) must be an integer >= 1, got {dp!r}")
    return dp


# ------------------------------------------------------------------------------------------
# Memory wall
# ------------------------------------------------------------------------------------------
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
    _check_count("num_params", num_params)
    b = _dtype_bytes(dtype)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATES)}")
    master = 0 if dtype == "fp32" else 4  # fp32 master weights in mixed precision
    k = master + 4 * OPTIMIZER_STATES[optimizer]
    out = {"params": round(b * num_params), "grads": round(b * num_params),
           "optimizer_states": round(k * num_params)}
    out["total"] = sum(out.values())
    return out


def zero_model_state_bytes(num_params: float, stage: int, dp: int, dtype: str = "fp32",
                           optimizer: str = "adam") -> dict:
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
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_dp(dp)
    full = model_state_bytes(num_params, dtype, optimizer)
    shard_elems = math.ceil(num_params / dp)
    sharded = {"optimizer_states": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    out = {}
    for cat, is_sharded in sharded.items():
        per_elem = full[cat] / num_params
        out[cat] = round(per_elem * shard_elems) if is_sharded else full[cat]
    out = {k: out[k] for k in ("params", "grads", "optimizer_states")}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(seq_len: int, micro_batch_size: int, hidden_size: int,
                               num_heads: int, tp: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none") -> int:
    """Bytes of activations one transformer layer saves for backward (16-bit activations).

    ``s·b·h·(34 + 5·a·s/h)`` without parallelism; with tensor parallelism t:
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``; with tensor + sequence parallelism:
    ``s·b·h·(34 + 5·a·s/h)/t``. ``recompute="selective"`` drops the 5·a·s/h attention term
    (score/softmax recomputed); ``"full"`` keeps only the layer input, 2·s·b·h (/t with SP).

    Args:
        seq_len: s (tokens); micro_batch_size: b (sequences); hidden_size: h; num_heads: a;
        tp: t, tensor-parallel degree (must divide ``num_heads``).

    Raises:
        ValueError: a non-positive size, ``tp`` not dividing ``num_heads``, unknown recompute.

    Source: Korthikanti et al. 2022 (arXiv 2205.05198), §4.1-4.2, eqs. 1-3 and §5. The paper's
    GPT layer has 2-byte activations and 1-byte dropout masks; llmlab's Llama layer (SwiGLU, RMSNorm,
    no dropout, fp32 by default) saves a different set of tensors, so the formula is a model of
    the scaling (linear in b, linear plus quadratic in s), not an exact count for it.
    """
    for name, v in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size),
                    ("hidden_size", hidden_size), ("num_heads", num_heads), ("tp", tp)):
        _check_count(name, v)
    if num_heads % tp:
        raise ValueError(f"tp={tp} must divide num_heads={num_heads}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    s, b, h, a, t = seq_len, micro_batch_size, hidden_size, num_heads, tp
    attn = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if recompute == "full":
        per = 2.0 / t if sequence_parallel else 2.0
    elif sequence_parallel:
        per = (34.0 + attn) / t
    else:
        per = 10.0 + 24.0 / t + attn / t
    return round(s * b * h * per)


def activation_bytes_per_rank(seq_len: int, micro_batch_size: int, hidden_size: int,
                              num_heads: int, tp: int = 1, sequence_parallel: bool = False,
                              recompute: str = "none", cp: int = 1) -> int:
    """Activation bytes one layer saves per rank with context parallelism over ``cp`` ranks.

    Every activation of a layer belongs to one token, and each CP rank holds ``s/cp`` tokens, so
    the per-rank bytes are :func:`activation_bytes_per_layer`'s divided by ``cp`` (Megatron-LM's
    context-parallel docs: "the activation memory footprint is reduced by cp times"). The
    quadratic attention term divides too: ring attention scores ``s/cp`` queries against one
    block at a time, Ulysses all ``s`` keys for ``a/cp`` heads. Raises ``ValueError`` if ``cp``
    is not a positive integer dividing ``seq_len``.
    """
    if not isinstance(cp, int) or cp < 1 or seq_len % cp:
        raise ValueError(f"cp={cp!r} must be a positive integer dividing seq_len={seq_len}")
    full = activation_bytes_per_layer(seq_len, micro_batch_size, hidden_size, num_heads, tp,
                                      sequence_parallel, recompute)
    return round(full / cp)


# ------------------------------------------------------------------------------------------
# Compute wall
# ------------------------------------------------------------------------------------------
def training_flops(num_params: float, num_tokens: float) -> float:
    """Total training FLOPs ``6·N·T`` (forward 2N, backward 4N per token).

    Raises ``ValueError`` for a non-positive count. Source: Kaplan et al. 2020 ("Scaling Laws for
    Neural Language Models"), §2.1; attention's extra 12·L·h·s per token (PaLM, App. B) is left
    out, as in the seed. :func:`llmlab.metrics.throughput.training_flops_per_token` includes it.
    """
    _check_count("num_params", num_params)
    _check_count("num_tokens", num_tokens)
    return 6.0 * num_params * num_tokens


def ideal_training_time_s(total_flops: float, peak_flops_per_s: float, num_gpus: int = 1,
                          mfu: float = 1.0) -> float:
    """Seconds to do ``total_flops`` on ``num_gpus`` devices at ``mfu`` × their peak FLOP/s.

    ``mfu=1`` is the ideal (the seed's "theoretical minimum"); real runs reach 0.3-0.55 (PaLM,
    Chowdhery et al. 2022, App. B). Raises ``ValueError`` for non-positive inputs or mfu > 1.
    """
    _check_count("total_flops", total_flops)
    _check_count("peak_flops_per_s", peak_flops_per_s)
    _check_count("num_gpus", num_gpus)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    return total_flops / (peak_flops_per_s * num_gpus * mfu)


# ------------------------------------------------------------------------------------------
# Communication wall
# ------------------------------------------------------------------------------------------
def ring_factor(world_size: int | None = None) -> float:
    """Bytes a ring all-reduce sends per rank, per byte reduced: 2(N-1)/N; 2 when N is None.

    Source: Patarasuk & Yuan 2009 (bandwidth-optimal all-reduce); ZeRO §7 uses the limit 2.
    """
    if world_size is None:
        return 2.0
    _check_dp(world_size)
    return 2.0 * (world_size - 1) / world_size


def ring_all_reduce_time_s(nbytes: float, bandwidth_bytes_per_s: float,
                           world_size: int | None = None, latency_s: float = 0.0) -> float:
    """α-β model of one ring all-reduce: ``latency_s + ring_factor(N) · nbytes / bandwidth``.

    ``latency_s`` is the fixed cost α per call (a real ring pays 2(N-1) hops of it).
    """
    _check_count("nbytes", nbytes, allow_zero=True)
    _check_count("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    return latency_s + ring_factor(world_size) * nbytes / bandwidth_bytes_per_s


def zero_comm_bytes_per_step(num_params: float, stage: int, dp: int | None = None,
                             dtype: str = "fp32") -> dict:
    """Bytes one rank sends per step for the gradient/parameter collectives of DDP or ZeRO.

    stage 0 (DDP): one all-reduce of the gradients; stages 1 and 2: reduce-scatter of the
    gradients + all-gather of the updated parameters (same 2Ψ); stage 3: an all-gather of the
    parameters in forward, another in backward, and a reduce-scatter: 3Ψ, 1.5× DDP. Each of
    these ring collectives sends (N-1)/N of its tensor per rank; ``dp=None`` uses the large-N
    limit 1 (the paper's Ψ units). Elements are ``dtype`` wide (gradients and 16-bit weights).

    Returns:
        ``{"all_reduce", "reduce_scatter", "all_gather", "total"}`` bytes sent per rank per
        step, and ``"payload"``: the same collectives in llmlab's counter convention
        (:mod:`llmlab.runtime.comm`: bytes of the full tensor per call, no ring factor).

    Source: ZeRO (Rajbhandari et al. 2020), §7.2.1 and §7.2.2.
    """
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_count("num_params", num_params)
    full = _dtype_bytes(dtype) * num_params
    f = 1.0 if dp is None else (_check_dp(dp) - 1) / dp
    calls = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
    if stage == 0:
        calls["all_reduce"] = 1
    else:
        calls["reduce_scatter"] = 1
        calls["all_gather"] = 2 if stage == 3 else 1
    wire_per_call = {"all_reduce": 2 * f * full, "reduce_scatter": f * full, "all_gather": f * full}
    out = {k: round(n * wire_per_call[k]) for k, n in calls.items()}
    out["total"] = sum(out.values())
    out["payload"] = {k: round(n * full) for k, n in calls.items()}
    return out


def communication_wall(num_params: float, num_tokens: float, tokens_per_step: float,
                       bandwidth_bytes_per_s: float, dtype: str = "fp32",
                       activation_comm_bytes: float = 0.0, world_size: int | None = None) -> dict:
    """Per-step and total time spent communicating, the seed's way (§2.3).

    Per step the gradients (Ψ × dtype bytes) plus ``activation_comm_bytes`` go through an
    all-reduce at ``bandwidth_bytes_per_s``; the ring sends ``ring_factor(world_size)`` (2 when
    ``world_size`` is None) times those bytes. Steps = tokens / tokens_per_step (rounded up).
    No overlap with compute is assumed: this is the wall, not the achieved step time.

    Returns:
        ``{"grad_bytes", "activation_bytes", "bytes_per_step", "ring_factor", "time_per_step_s",
        "num_steps", "total_time_s"}``.

    Example (the seed): 8e9 fp32 parameters, 80e9 activation bytes, 2.5e11 tokens, 4e6 tokens
    per step, 64e9 B/s: 112e9 bytes per step, 3.5 s, 62,500 steps, 218,750 s = 60.76 h.
    """
    _check_count("num_tokens", num_tokens)
    _check_count("tokens_per_step", tokens_per_step)
    _check_count("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    _check_count("activation_comm_bytes", activation_comm_bytes, allow_zero=True)
    grads = model_state_bytes(num_params, dtype, "sgd")["grads"]
    per_step = grads + activation_comm_bytes
    t = ring_all_reduce_time_s(per_step, bandwidth_bytes_per_s, world_size)
    steps = math.ceil(num_tokens / tokens_per_step)
    return {"grad_bytes": grads, "activation_bytes": activation_comm_bytes,
            "bytes_per_step": per_step, "ring_factor": ring_factor(world_size),
            "time_per_step_s": t, "num_steps": steps, "total_time_s": t * steps}


# ------------------------------------------------------------------------------------------
# `llmlab estimate`
# ------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, default=None, help="number of parameters (e.g. 8e9)")
    p.add_argument("--model", default=None, help="a preset (tiny, small, ...) instead of --params; "
                   "also sets layers, hidden size and heads for the activation formula")
    p.add_argument("--dtype", default="fp32", help="fp32, or bf16/fp16 (mixed precision, fp32 "
                   "master weights and optimizer states)")
    p.add_argument("--optimizer", default="adam", help="adam, adamw, momentum or sgd")
    p.add_argument("--tokens", type=float, default=None, help="training tokens (e.g. 2.5e11)")
    p.add_argument("--gpu-tflops", type=float, default=None, help="peak TFLOP/s of one GPU")
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--mfu", type=float, default=1.0, help="fraction of peak reached (1 = ideal)")
    p.add_argument("--zero", type=int, default=None, help="ZeRO stage 0-3 (needs --dp)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks: per-rank bytes for "
                   "each ZeRO stage; the ring factor becomes 2(N-1)/N instead of its limit 2")
    p.add_argument("--tokens-per-step", type=float, default=None, help="global batch in tokens")
    p.add_argument("--bandwidth-gb-s", type=float, default=None,
                   help="all-reduce bandwidth in GB/s (1e9 bytes/s)")
    p.add_argument("--activation-comm-bytes", type=float, default=0.0,
                   help="activation bytes communicated per step (the seed: 80e9)")
    p.add_argument("--seq-len", type=int, default=None, help="for activation memory (with "
                   "--micro-batch-size and --model, or --num-layers/--hidden-size/--num-heads)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks: activations per rank "
                   "(each holds seq-len/cp tokens)")
    p.add_argument("--recompute", default="none", help="none, selective or full")
    p.add_argument("--json", default=None, help="also write the estimate here")


def estimate(args: argparse.Namespace) -> dict:
    """Everything ``llmlab estimate`` computes, as a JSON-ready dict (bytes, FLOPs, seconds)."""
    layers, hidden, heads = args.num_layers, args.hidden_size, args.num_heads
    if (args.params is None) == (args.model is None):
        raise ValueError("give exactly one of --params N or --model PRESET")
    if args.model is not None:
        from llmlab.model.config import get_preset
        mc = get_preset(args.model)
        n = mc.num_parameters()
        layers = layers or mc.num_hidden_layers
        hidden = hidden or mc.hidden_size
        heads = heads or mc.num_attention_heads
    else:
        n = args.params
    if args.zero is not None and args.dp is None:
        raise ValueError("--zero needs --dp (the number of data-parallel ranks to shard over)")
    if args.zero is not None and args.zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {args.zero}")
    if args.dp is not None:
        _check_dp(args.dp)
    out = {"inputs": {k: v for k, v in vars(args).items() if k not in ("command", "json")} |
           {"num_params": n},
           "memory": {"dtype": args.dtype, "optimizer": args.optimizer,
                      "bytes": model_state_bytes(n, args.dtype, args.optimizer)}}
    if args.seq_len is not None:
        if None in (layers, hidden, heads):
            raise ValueError("activation memory needs --model or --num-layers, --hidden-size "
                             "and --num-heads")
        cp = getattr(args, "cp", 1)
        per_layer = activation_bytes_per_rank(args.seq_len, args.micro_batch_size, hidden, heads,
                                              args.tp, args.sequence_parallel, args.recompute, cp)
        out["memory"]["activations_per_layer"] = per_layer
        out["memory"]["activations"] = per_layer * layers
        if cp > 1:
            out["memory"]["cp"] = cp
    if args.tokens is not None:
        flops = training_flops(n, args.tokens)
        out["compute"] = {"training_flops": flops}
        if args.gpu_tflops is not None:
            t = ideal_training_time_s(flops, args.gpu_tflops * 1e12, args.num_gpus, args.mfu)
            out["compute"] |= {"peak_flops_per_s": args.gpu_tflops * 1e12 * args.num_gpus,
                               "mfu": args.mfu, "time_s": t, "time_days": t / SECONDS_PER_DAY}
    elif args.gpu_tflops is not None:
        raise ValueError("--gpu-tflops needs --tokens (the training tokens)")
    if args.tokens_per_step is not None or args.bandwidth_gb_s is not None:
        if None in (args.tokens, args.tokens_per_step, args.bandwidth_gb_s):
            raise ValueError("the communication wall needs --tokens, --tokens-per-step and "
                             "--bandwidth-gb-s")
        c = communication_wall(n, args.tokens, args.tokens_per_step, args.bandwidth_gb_s * GB,
                               args.dtype, args.activation_comm_bytes, args.dp)
        out["communication"] = c | {"total_time_h": c["total_time_s"] / 3600}
    if args.dp is not None:
        out["zero"] = {"dp": args.dp, "stage": args.zero, "stages": {
            str(s): {"bytes_per_rank": zero_model_state_bytes(n, s, args.dp, args.dtype,
                                                              args.optimizer),
                     "comm_bytes_per_step": zero_comm_bytes_per_step(n, s, args.dp, args.dtype)}
            for s in range(4)}}
        if args.zero is not None:
            out["zero"]["bytes_per_rank"] = out["zero"]["stages"][str(args.zero)]["bytes_per_rank"]
    return out


def _gb(x: float) -> str:
    """Decimal units: GB = 1e9 bytes (MB = 1e6, kB = 1e3 below 1 GB)."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f} B"


def format_table(est: dict) -> str:
    """The human-readable report of :func:`estimate` (GB = 1e9 bytes)."""
    m, lines = est["memory"], []
    n = est["inputs"]["num_params"]
    count = f"{int(n):,}" if n < 1e7 and n == int(n) else f"{n:.4g}"
    lines.append(f"Memory wall  ({count} parameters, {m['dtype']}, {m['optimizer']}; "
                 f"GB = 1e9 bytes, MB = 1e6)")
    for k, label in (("params", "parameters"), ("grads", "gradients"),
                     ("optimizer_states", "optimizer states"), ("total", "total model states")):
        lines.append(f"  {label:<22}{_gb(m['bytes'][k]):>16}")
    if "activations" in m:
        per_rank = f", per rank over cp = {m['cp']}" if m.get("cp") else ""
        lines.append(f"  {'activations/layer':<22}{_gb(m['activations_per_layer']):>16}"
                     f"   (Korthikanti et al. 2022{per_rank})")
        lines.append(f"  {'activations, all':<22}{_gb(m['activations']):>16}")
    if "compute" in est:
        c = est["compute"]
        lines.append("Compute wall  (6·N·T)")
        lines.append(f"  {'training FLOPs':<22}{c['training_flops']:>16.3e}")
        if "time_s" in c:
            lines.append(f"  {'peak FLOP/s (all GPUs)':<22}{c['peak_flops_per_s']:>16.3e}"
                         f"   at MFU {c['mfu']:g}")
            lines.append(f"  {'ideal time':<22}{c['time_s']:>14.4g} s   = "
                         f"{c['time_days']:,.1f} days")
    if "communication" in est:
        c = est["communication"]
        lines.append(f"Communication wall  (a ring all-reduce of B bytes sends "
                     f"{c['ring_factor']:.3g} x B per rank)")
        lines.append(f"  {'bytes per step':<22}{_gb(c['bytes_per_step']):>16}   = "
                     f"{_gb(c['grad_bytes'])} gradients + {_gb(c['activation_bytes'])} activations")
        lines.append(f"  {'time per step':<22}{c['time_per_step_s']:>14.4g} s   = "
                     f"{c['ring_factor']:.3g} x {_gb(c['bytes_per_step'])} / bandwidth")
        lines.append(f"  {'steps':<22}{c['num_steps']:>16,}")
        lines.append(f"  {'total':<22}{c['total_time_s']:>14.4g} s   = "
                     f"{c['total_time_h']:,.2f} hours")
    if "zero" in est:
        z = est["zero"]
        lines.append(f"ZeRO per rank, dp = {z['dp']}  (Rajbhandari et al. 2020, §5, §7)")
        lines.append(f"  {'stage':<8}{'params':>14}{'grads':>14}{'optimizer':>14}{'total':>14}"
                     f"{'comm/step':>14}")
        for s, row in z["stages"].items():
            b = row["bytes_per_rank"]
            mark = " <" if z["stage"] is not None and int(s) == z["stage"] else ""
            lines.append(f"  {s:<8}" + "".join(f"{_gb(b[k]):>14}" for k in
                         ("params", "grads", "optimizer_states", "total"))
                         + f"{_gb(row['comm_bytes_per_step']['total']):>14}{mark}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    est = estimate(args)
    print(format_table(est))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(est, indent=1))
        print(f"estimate written to {args.json}")
    return 0
