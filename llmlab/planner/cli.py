"""``llmlab plan``: rank every layout of a model on a cluster; ``--calibrate``, ``--validate``.

Examples::

    llmlab plan --params 8e9 --num-gpus 8 --gpu-memory-gb 80 --json plan.json
    llmlab plan --model llama3-70b --cluster h100 --num-gpus 1024
    llmlab plan --model tiny --num-gpus 4 --validate      # calibrate, then train in miniature
"""

from __future__ import annotations

import argparse
import json

from llmlab.planner.cluster import GB


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (one of)")
    g.add_argument("--params", type=float, default=None, help="parameter count (e.g. 8e9)")
    g.add_argument(
        "--model",
        default=None,
        help="a preset: llama3-8b, qwen3-8b, llama3-70b, mixtral-8x7b or an llmlab preset (tiny, small, ...)",
    )
    g.add_argument("--config", default=None, metavar="config.json", help="a Hugging Face config.json")
    for flag, help_ in (
        ("--num-layers", "layers"),
        ("--hidden-size", "hidden size"),
        ("--num-heads", "attention heads"),
        ("--num-kv-heads", "key/value heads"),
        ("--vocab-size", "vocabulary"),
    ):
        g.add_argument(flag, type=int, default=None, help=f"{help_}, with --params")
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", default="a800", help="node preset: a100, a800, h100, h200")
    c.add_argument("--num-gpus", type=int, default=8, help="GPUs (ranks with --validate)")
    c.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (preset: 8)")
    c.add_argument("--gpu-memory-gb", type=float, default=None, help="GB (1e9 bytes) per GPU")
    c.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per GPU in --dtype")
    c.add_argument("--achievable-fraction", type=float, default=None, help="share of peak a matmul reaches")
    c.add_argument("--intra-bw-gb-s", type=float, default=None, help="busbw inside a node, GB/s per GPU")
    c.add_argument("--inter-bw-gb-s", type=float, default=None, help="busbw between nodes, GB/s per GPU")
    c.add_argument("--intra-latency-us", type=float, default=None, help="α inside a node, µs")
    c.add_argument("--inter-latency-us", type=float, default=None, help="α between nodes, µs")
    w = p.add_argument_group("workload")
    w.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    w.add_argument("--global-batch-tokens", type=float, default=4 * 2**20, help="tokens per step")
    w.add_argument("--dtype", default="bf16", help="bf16/fp16 (mixed precision) or fp32")
    w.add_argument("--tokens", type=float, default=2.5e11, help="token budget for the time to train")
    p.add_argument("--top", type=int, default=15, help="rows to print")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's FLOP/s and "
        "each collective's α, β on --num-gpus local ranks, and plan for it",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="calibrate, then train the top layouts "
        "of --model (an llmlab preset) on --num-gpus local ranks and compare",
    )
    p.add_argument("--validate-layouts", type=int, default=6, help="layouts to train")
    p.add_argument("--validate-steps", type=int, default=8, help="steps per layout (2 warm-up)")
    p.add_argument("--json", default=None, metavar="F", help="write the plan (and validation) here")
    from llmlab.planner.serve_cli import add_serve_arguments

    add_serve_arguments(p)  # --serve, --articles and the serving flags


def _cluster(args):
    from llmlab.planner.cluster import cluster_preset

    c = cluster_preset(args.cluster, args.num_gpus)
    kw = {}
    for flag, field, scale in (
        ("gpus_per_node", "gpus_per_node", 1),
        ("gpu_memory_gb", "gpu_memory_bytes", GB),
        ("achievable_fraction", "achievable_fraction", 1),
        ("intra_bw_gb_s", "intra_bandwidth", GB),
        ("inter_bw_gb_s", "inter_bandwidth", GB),
        ("intra_latency_us", "intra_latency", 1e-6),
        ("inter_latency_us", "inter_latency", 1e-6),
    ):
        if getattr(args, flag) is not None:
            kw[field] = getattr(args, flag) * scale
    if "gpus_per_node" in kw:
        kw["gpus_per_node"] = int(kw["gpus_per_node"])
    elif args.num_gpus < c.gpus_per_node:
        kw["gpus_per_node"] = args.num_gpus
    if args.peak_tflops is not None:
        kw["peak_flops"] = dict(c.peak_flops) | {args.dtype: args.peak_tflops * 1e12}
    return c.replace(**kw).validate()


def run(args: argparse.Namespace) -> int:
    from llmlab.planner.inputs import check_args

    check_args(args)  # every flag, before any planning (and before torch: calibrate imports it)
    if getattr(args, "serve", False) or getattr(args, "articles", False):
        from llmlab.planner.serve_cli import run_serve

        return run_serve(args)
    from llmlab.planner.api import plan
    from llmlab.planner.report import format_table, format_validation
    from llmlab.planner.specs import Workload

    if args.validate and (args.model is None or args.params is not None or args.config is not None):
        raise ValueError("--validate trains an llmlab preset: give --model tiny (or small, ...)")
    workload = Workload(args.seq_len, int(args.global_batch_tokens), args.dtype, "adam", args.tokens)
    if args.validate:  # the miniature workload the runs use
        workload = Workload(256, 256 * 16, "fp32", "adamw", args.tokens)
        print("--validate plans (and trains) 16 sequences of 256 tokens per step, fp32, AdamW")
    shape = dict(
        num_layers=args.num_layers,
        hidden=args.hidden_size,
        heads=args.num_heads,
        kv_heads=args.num_kv_heads,
        vocab=args.vocab_size,
    )
    if args.calibrate or args.validate:  # refuse a plan with no layout before any rank starts
        from llmlab.planner.cluster import cluster_preset

        n = args.num_gpus
        plan(
            args.model,
            params=args.params,
            config=args.config,
            workload=workload,
            cluster=cluster_preset("a100", n, gpus_per_node=n),
            **shape,
        )
        from llmlab.model.config import PRESETS
        from llmlab.planner.calibrate import calibrate

        # the model whose FLOP/s is measured: the llmlab preset asked about, else tiny
        cluster = calibrate(
            args.num_gpus, args.model if args.model in PRESETS else "tiny", dtype=workload.dtype
        )
        links = cluster.op_links
        if links is None:  # calibrate() always measures them
            raise RuntimeError("calibration measured no links")
        print(
            f"calibrated {cluster.name}: all-reduce α {links['all_reduce']['latency'] * 1e6:.0f} µs, "
            f"β {links['all_reduce']['bandwidth'] / GB:.2f} GB/s; "
            f"model {max(r for _, r in links['model']) / 1e9:.1f} GFLOP/s per rank"
        )
    else:
        cluster = _cluster(args)
    result = plan(
        args.model, params=args.params, config=args.config, cluster=cluster, workload=workload, **shape
    )
    print(format_table(result, args.top))
    if args.validate:
        from llmlab.planner.validate import validate

        result["validation"] = validate(
            cluster, args.model, count=args.validate_layouts, steps=args.validate_steps
        )
        print(format_validation(result["validation"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"plan written to {args.json}")
    return 0 if any(r["fits"] for r in result["layouts"]) else 1  # 1: no layout fits (headline)
