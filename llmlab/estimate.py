"""``llmlab estimate``: the three walls of training a large model (memory, compute,
communication) for a model size, a machine and a layout, printed as a table or written as JSON.

The formulas live in :mod:`llmlab.formulas` (one module per family; the sources are cited there);
this module reads the command line, calls them and formats the answer. Units: bytes, FLOPs,
seconds; the printed table uses GB = 1e9 bytes (decimal, as the source articles and the ZeRO
paper do; 1 GiB = 1.074 GB).

* Memory: :func:`~llmlab.formulas.memory.model_state_bytes`,
  :func:`~llmlab.formulas.memory.zero_model_state_bytes`, and with ``--seq-len`` Korthikanti's
  :func:`~llmlab.formulas.activations.activation_bytes_per_layer`.
* Compute: :func:`~llmlab.formulas.compute.training_flops` (6·N·T) and
  :func:`~llmlab.formulas.compute.ideal_training_time_s`. The source articles' 8B model on
  2.5e11 tokens: 1.2e22 FLOPs, ≈ 445 days on one 312 TFLOP/s GPU.
* Communication: :func:`~llmlab.formulas.communication.communication_wall`. The source articles
  count 112 GB per step (32 GB of fp32 gradients + 80 GB of activations) through an all-reduce
  (factor 2) at 64 GB/s: 3.5 s per step, 62,500 steps, 218,750 s ≈ 60.76 hours. (They call
  64 GB/s "InfiniBand HDR"; one HDR port carries 200 Gbit/s = 25 GB/s, so read it as the node's
  aggregate bandwidth.) Per-step volume of DDP and ZeRO:
  :func:`~llmlab.formulas.communication.zero_comm_bytes_per_step`.

Command line: ``llmlab estimate --params 8e9 --dtype fp32 --optimizer adam --tokens 2.5e11
--gpu-tflops 312 --num-gpus 1 [--zero S --dp N] [--tokens-per-step 4e6 --bandwidth-gb-s 64
--activation-comm-bytes 80e9] [--seq-len S --cp N] [--json PATH]``; with ``--cp N`` the
activation memory is per context-parallel rank
(:func:`~llmlab.formulas.activations.activation_bytes_per_rank`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmlab.formulas._checks import check_flag
from llmlab.formulas.activations import activation_bytes_per_layer, activation_bytes_per_rank
from llmlab.formulas.communication import (
    communication_wall,
    ring_all_reduce_time,
    ring_factor,
    zero_comm_bytes_per_step,
)
from llmlab.formulas.compute import ideal_training_time_s, training_flops
from llmlab.formulas.memory import model_state_bytes, zero_model_state_bytes

__all__ = [
    "add_arguments",
    "estimate",
    "format_table",
    "run",
    "GB",
    "SECONDS_PER_DAY",
    # the formulas it combines, importable from here too (lab 00 uses ``E.<formula>``)
    "activation_bytes_per_layer",
    "activation_bytes_per_rank",
    "communication_wall",
    "ring_all_reduce_time",
    "ring_factor",
    "zero_comm_bytes_per_step",
    "ideal_training_time_s",
    "training_flops",
    "model_state_bytes",
    "zero_model_state_bytes",
]

GB = 1e9  # bytes; decimal, as the source articles and the ZeRO paper use
SECONDS_PER_DAY = 86400.0


# ------------------------------------------------------------------------------------------
# `llmlab estimate`
# ------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, default=None, help="number of parameters (e.g. 8e9)")
    p.add_argument(
        "--model",
        default=None,
        help="a preset (tiny, small, ...) instead of --params; "
        "also sets layers, hidden size and heads for the activation formula",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        help="fp32, or bf16/fp16 (mixed precision, fp32 master weights and optimizer states)",
    )
    p.add_argument("--optimizer", default="adam", help="adam, adamw, momentum or sgd")
    p.add_argument("--tokens", type=float, default=None, help="training tokens (e.g. 2.5e11)")
    p.add_argument("--gpu-tflops", type=float, default=None, help="peak TFLOP/s of one GPU")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs sharing the compute")
    p.add_argument("--mfu", type=float, default=1.0, help="fraction of peak reached (1 = ideal)")
    p.add_argument("--zero", type=int, default=None, help="ZeRO stage 0-3 (needs --dp)")
    p.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel ranks: per-rank bytes for "
        "each ZeRO stage; the ring factor becomes 2(N-1)/N instead of its limit 2",
    )
    p.add_argument("--tokens-per-step", type=float, default=None, help="global batch in tokens")
    p.add_argument(
        "--bandwidth-gb-s", type=float, default=None, help="all-reduce bandwidth in GB/s (1e9 bytes/s)"
    )
    p.add_argument(
        "--activation-comm-bytes",
        type=float,
        default=0.0,
        help="activation bytes communicated per step (the source articles: 80e9)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="for activation memory (with "
        "--micro-batch-size and --model, or --num-layers/--hidden-size/--num-heads)",
    )
    p.add_argument(
        "--micro-batch-size", type=int, default=1, help="sequences per micro-batch (activation memory)"
    )
    p.add_argument("--num-layers", type=int, default=None, help="layers, with --params (instead of --model)")
    p.add_argument(
        "--hidden-size", type=int, default=None, help="hidden size, with --params (instead of --model)"
    )
    p.add_argument(
        "--num-heads", type=int, default=None, help="attention heads, with --params (instead of --model)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (activation memory)")
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks: activations per rank (each holds seq-len/cp tokens)",
    )
    p.add_argument(
        "--sequence-parallel", action="store_true", help="with --tp: activations split along the sequence too"
    )
    p.add_argument("--recompute", default="none", help="none, selective or full")
    p.add_argument("--json", default=None, help="also write the estimate here")
    p.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        help="memory of one GPU (GB): "
        "how many GPUs hold the parameters, the model states and the activations",
    )


# Numeric flags, checked before any formula runs: whole numbers (argparse dest -> least value) and
# reals (dest -> whether 0 is allowed; else > 0), all bounded (formulas._checks.check_flag).
COUNT_FLAGS = {
    "num_gpus": 1,
    "dp": 1,
    "seq_len": 1,
    "micro_batch_size": 1,
    "num_layers": 1,
    "hidden_size": 1,
    "num_heads": 1,
    "tp": 1,
    "cp": 1,
}
REAL_FLAGS = {
    "params": False,
    "tokens": False,
    "gpu_tflops": False,
    "tokens_per_step": False,
    "bandwidth_gb_s": False,
    "activation_comm_bytes": True,
    "gpu_memory_gb": False,
}
CHOICES = {
    "dtype": ("fp32", "bf16", "fp16"),
    "optimizer": ("adam", "adamw", "momentum", "sgd"),
    "recompute": ("none", "selective", "full"),
    "zero": (0, 1, 2, 3),
}


def check_args(args: argparse.Namespace) -> None:
    """Every numeric flag given: a finite number in its range (0 is an error where it means
    nothing, never a default), choices, and the shape's constraints (``--num-heads`` divides
    ``--hidden-size``, ``--tp`` divides ``--num-heads``, ``--cp`` divides ``--seq-len``).
    Raises ``ValueError`` naming the flag."""

    def flag(dest: str) -> str:
        return "--" + dest.replace("_", "-")

    for dest, least in COUNT_FLAGS.items():
        if getattr(args, dest, None) is not None:
            check_flag(flag(dest), getattr(args, dest), integer=True, least=least, most=10**9)
    for dest, zero_ok in REAL_FLAGS.items():
        if getattr(args, dest, None) is not None:
            check_flag(flag(dest), getattr(args, dest), zero_ok=zero_ok)
    check_flag("--mfu", getattr(args, "mfu", 1.0), most=1.0)  # a share of the peak: (0, 1]
    for dest, allowed in CHOICES.items():
        v = getattr(args, dest, None)
        if v is not None and v not in allowed:
            raise ValueError(f"{flag(dest)} {v!r}: expected one of {', '.join(map(str, allowed))}")
    hidden, heads, tp = args.hidden_size, args.num_heads, getattr(args, "tp", 1)
    if hidden is not None and heads is not None and hidden % heads:
        raise ValueError(f"--num-heads {heads} must divide --hidden-size {hidden}")
    if heads is not None and heads % tp:
        raise ValueError(f"--tp {tp} must divide --num-heads {heads}")
    cp = getattr(args, "cp", 1)
    if args.seq_len is not None and args.seq_len % cp:
        raise ValueError(f"--cp {cp} must divide --seq-len {args.seq_len}")


def estimate(args: argparse.Namespace) -> dict:
    """Everything ``llmlab estimate`` computes, as a JSON-ready dict (bytes, FLOPs, seconds).
    Raises ``ValueError`` naming the flag (:func:`check_args`) or the missing companion flag."""
    check_args(args)
    n, layers, hidden, heads = _model_shape(args)
    if args.zero is not None and args.dp is None:
        raise ValueError("--zero needs --dp (the number of data-parallel ranks to shard over)")
    out = {
        "inputs": {k: v for k, v in vars(args).items() if k not in ("command", "module", "json")}
        | {"num_params": n},
        "memory": _memory(args, n, layers, hidden, heads),
    }
    if args.tokens is not None:
        out["compute"] = _compute(args, n)
    elif args.gpu_tflops is not None:
        raise ValueError("--gpu-tflops needs --tokens (the training tokens)")
    if args.tokens_per_step is not None or args.bandwidth_gb_s is not None:
        out["communication"] = _communication(args, n)
    if args.dp is not None:
        out["zero"] = _zero(args, n)
    return out


def _model_shape(args: argparse.Namespace) -> tuple:
    """``(num_params, layers, hidden, heads)`` from ``--params`` (with the shape flags) or
    ``--model PRESET`` (the flags given override the preset's). Raises ``ValueError``."""
    layers, hidden, heads = args.num_layers, args.hidden_size, args.num_heads
    if (args.params is None) == (args.model is None):
        raise ValueError(
            "give exactly one of --params N or --model PRESET (--num-layers, "
            "--hidden-size and --num-heads go with --params)"
        )
    if args.model is None:
        return args.params, layers, hidden, heads
    from llmlab.model.config import get_preset

    mc = get_preset(args.model)
    layers = mc.num_hidden_layers if layers is None else layers
    hidden = mc.hidden_size if hidden is None else hidden
    heads = mc.num_attention_heads if heads is None else heads
    if hidden % heads:
        raise ValueError(
            f"--num-heads {heads} must divide --hidden-size {hidden} (--model {args.model}'s, unless given)"
        )
    if heads % args.tp:
        raise ValueError(
            f"--tp {args.tp} must divide --num-heads {heads} (--model {args.model}'s, unless given)"
        )
    return mc.num_parameters(), layers, hidden, heads


def _memory(args: argparse.Namespace, n: int, layers: int, hidden: int, heads: int) -> dict:
    """The memory wall: model states, activations (with ``--seq-len``), GPUs needed."""
    mem: dict = {
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "bytes": model_state_bytes(n, args.dtype, args.optimizer),
    }
    if args.seq_len is not None:
        if None in (layers, hidden, heads):
            raise ValueError("activation memory needs --model or --num-layers, --hidden-size and --num-heads")
        cp = getattr(args, "cp", 1)
        per_layer = activation_bytes_per_rank(
            args.seq_len,
            args.micro_batch_size,
            hidden,
            heads,
            args.tp,
            args.sequence_parallel,
            args.recompute,
            cp,
        )
        if cp > 1:
            mem["cp"] = cp
        mem["activations_per_layer"] = per_layer
        mem["activations"] = per_layer * layers
    if getattr(args, "gpu_memory_gb", None) is not None:
        mem["gpus_needed"] = _gpus_needed(mem, args.gpu_memory_gb)
    return mem


def _compute(args: argparse.Namespace, n: int) -> dict:
    """The compute wall: 6·N·D training FLOPs and, with ``--gpu-tflops``, the ideal time."""
    flops = training_flops(n, args.tokens)
    out: dict = {"training_flops": flops}
    if args.gpu_tflops is not None:
        t = ideal_training_time_s(flops, args.gpu_tflops * 1e12, args.num_gpus, args.mfu)
        out |= {
            "peak_flops_per_s": args.gpu_tflops * 1e12 * args.num_gpus,
            "mfu": args.mfu,
            "time_s": t,
            "time_days": t / SECONDS_PER_DAY,
        }
    return out


def _communication(args: argparse.Namespace, n: int) -> dict:
    """The communication wall (needs ``--tokens``, ``--tokens-per-step``, ``--bandwidth-gb-s``)."""
    if None in (args.tokens, args.tokens_per_step, args.bandwidth_gb_s):
        raise ValueError("the communication wall needs --tokens, --tokens-per-step and --bandwidth-gb-s")
    c = communication_wall(
        n,
        args.tokens,
        args.tokens_per_step,
        args.bandwidth_gb_s * GB,
        args.dtype,
        args.activation_comm_bytes,
        args.dp,
    )
    return c | {"total_time_h": c["total_time_s"] / 3600}


def _zero(args: argparse.Namespace, n: int) -> dict:
    """Bytes per rank and communication per step of ZeRO stages 0-3 over ``--dp`` ranks."""
    out: dict = {
        "dp": args.dp,
        "stage": args.zero,
        "stages": {
            str(s): {
                "bytes_per_rank": zero_model_state_bytes(n, s, args.dp, args.dtype, args.optimizer),
                "comm_bytes_per_step": zero_comm_bytes_per_step(n, s, args.dp, args.dtype),
            }
            for s in range(4)
        },
    }
    if args.zero is not None:
        out["bytes_per_rank"] = out["stages"][str(args.zero)]["bytes_per_rank"]
    return out


def _gpus_needed(mem: dict, gpu_memory_gb: float) -> dict:
    """The fewest GPUs of ``gpu_memory_gb`` that hold the parameters, the model states and
    (with ``--seq-len``) the states plus activations: ceil(bytes / memory)."""
    from llmlab.formulas.serving import gpus_for_bytes

    if not gpu_memory_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be > 0, got {gpu_memory_gb}")
    b = mem["bytes"]
    need = {
        "gpu_memory_bytes": gpu_memory_gb * GB,
        "params": gpus_for_bytes(b["params"], gpu_memory_gb * GB),
        "model_states": gpus_for_bytes(b["total"], gpu_memory_gb * GB),
    }
    if "activations" in mem:
        need["with_activations"] = gpus_for_bytes(b["total"] + mem["activations"], gpu_memory_gb * GB)
    return need


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
    lines.append(
        f"Memory wall  ({count} parameters, {m['dtype']}, {m['optimizer']}; GB = 1e9 bytes, MB = 1e6)"
    )
    for k, label in (
        ("params", "parameters"),
        ("grads", "gradients"),
        ("optimizer_states", "optimizer states"),
        ("total", "total model states"),
    ):
        lines.append(f"  {label:<22}{_gb(m['bytes'][k]):>16}")
    if "activations" in m:
        per_rank = f", per rank over cp = {m['cp']}" if m.get("cp") else ""
        lines.append(
            f"  {'activations/layer':<22}{_gb(m['activations_per_layer']):>16}"
            f"   (Korthikanti et al. 2022{per_rank})"
        )
        lines.append(f"  {'activations, all':<22}{_gb(m['activations']):>16}")
    if "gpus_needed" in m:
        g = m["gpus_needed"]
        lines.append(
            f"  {'GPUs of ' + _gb(g['gpu_memory_bytes']):<22}{g['params']:>10} for the "
            f"parameters, {g['model_states']} for the model states"
            + (f", {g['with_activations']} with the activations" if "with_activations" in g else "")
        )
    if "compute" in est:
        c = est["compute"]
        lines.append("Compute wall  (6·N·T)")
        lines.append(f"  {'training FLOPs':<22}{c['training_flops']:>16.3e}")
        if "time_s" in c:
            lines.append(
                f"  {'peak FLOP/s (all GPUs)':<22}{c['peak_flops_per_s']:>16.3e}   at MFU {c['mfu']:g}"
            )
            lines.append(f"  {'ideal time':<22}{c['time_s']:>14.4g} s   = {c['time_days']:,.1f} days")
    if "communication" in est:
        c = est["communication"]
        lines.append(
            f"Communication wall  (a ring all-reduce of B bytes sends {c['ring_factor']:.3g} x B per rank)"
        )
        lines.append(
            f"  {'bytes per step':<22}{_gb(c['bytes_per_step']):>16}   = "
            f"{_gb(c['grad_bytes'])} gradients + {_gb(c['activation_bytes'])} activations"
        )
        lines.append(
            f"  {'time per step':<22}{c['time_per_step_s']:>14.4g} s   = "
            f"{c['ring_factor']:.3g} x {_gb(c['bytes_per_step'])} / bandwidth"
        )
        lines.append(f"  {'steps':<22}{c['num_steps']:>16,}")
        lines.append(f"  {'total':<22}{c['total_time_s']:>14.4g} s   = {c['total_time_h']:,.2f} hours")
    if "zero" in est:
        z = est["zero"]
        lines.append(f"ZeRO per rank, dp = {z['dp']}  (Rajbhandari et al. 2020, §5, §7)")
        lines.append(
            f"  {'stage':<8}{'params':>14}{'grads':>14}{'optimizer':>14}{'total':>14}{'comm/step':>14}"
        )
        for s, row in z["stages"].items():
            b = row["bytes_per_rank"]
            mark = " <" if z["stage"] is not None and int(s) == z["stage"] else ""
            lines.append(
                f"  {s:<8}"
                + "".join(f"{_gb(b[k]):>14}" for k in ("params", "grads", "optimizer_states", "total"))
                + f"{_gb(row['comm_bytes_per_step']['total']):>14}{mark}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    est = estimate(args)
    print(format_table(est))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(est, indent=1))
        print(f"estimate written to {args.json}")
    return 0
