"""``llmlab plan --serve``: the serving half of the planner (flags, table, JSON).

Examples::

    llmlab plan --serve --model qwen2.5-7b --num-gpus 8 --max-model-len 10240
    llmlab plan --serve --model qwen2.5-72b --cluster a800 --num-gpus 16 --concurrency 64 --json s.json
    llmlab plan --serve --config llmlab/assets/models/shakespeare/config.json --num-gpus 1 --prompt-len 256 --output-len 128 --request-rate 20 --weight-dtype int8 --kv-dtype fp8
    llmlab plan --serve --calibrate          # this machine's bandwidth and FLOP/s, then the engine
    llmlab plan --articles                   # the source articles' figures, computed
"""

from __future__ import annotations

import argparse
import json


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--serve`` flag block (``--model``, ``--params``, ``--config``, ``--cluster``,
    ``--num-gpus``, ``--gpus-per-node``, ``--gpu-memory-gb``, ``--top``, ``--json`` are shared
    with the training planner)."""
    s = p.add_argument_group("serving (with --serve)")
    s.add_argument(
        "--serve",
        action="store_true",
        help="plan a serving deployment: TP x PP x instances, KV pool, concurrency, TTFT, TPOT, tokens/s",
    )
    s.add_argument(
        "--articles",
        action="store_true",
        help="compute the source articles' figures "
        "(10240 -> 128, paged KV +300%%, 8B 96/224 GB, 175B -> 22 A100s) and exit",
    )
    s.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per request")
    s.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    s.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    s.add_argument("--concurrency", type=int, default=None, help="requests in flight in all")
    s.add_argument("--request-rate", type=float, default=None, help="requests per second in all")
    s.add_argument("--weight-dtype", default="bf16", help="fp32, bf16, fp16, fp8, int8 or int4")
    s.add_argument(
        "--kv-dtype", default="auto", help="auto (the weights', bf16 if quantized), fp32, bf16, fp16 or fp8"
    )
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    s.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of each GPU's memory vLLM may use"
    )
    s.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step per instance")
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens of the profile forward (default: max(2048, max-model-len))",
    )
    s.add_argument(
        "--hbm-bw-gb-s",
        type=float,
        default=None,
        help="HBM bandwidth per GPU, GB/s (default: the preset's data sheet)",
    )


def format_serve_table(res: dict, top: int = 15) -> str:
    m, c, w = res["model"], res["cluster"], res["workload"]
    load = (
        f"concurrency {w['concurrency']}"
        if w["concurrency"]
        else f"{w['request_rate']:g} requests/s"
        if w["request_rate"]
        else "as many requests as fit"
    )
    n = m["num_params"]
    count = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
    lines = [
        f"{m['name']}: {count} parameters ({m['num_layers']} layers, "
        f"{m['kv_heads']} KV heads x {m['head_dim']}); {c['num_gpus']} x {c['name']} GPUs "
        f"({c['gpu_memory_bytes'] / 1e9:.0f} GB, {c['hbm_bandwidth'] / 1e12:.2f} TB/s, "
        f"{c['gpus_per_node']} per node); weights {w['weight_dtype']}, KV "
        f"{w['kv_dtype'] if w['kv_dtype'] != 'auto' else 'auto'}; max-model-len {w['max_model_len']:,}; "
        f"requests {w['prompt_len']} + {w['output_len']} tokens, {load}",
        f"{'#':>3} {'layout':<26} {'KV B/tok':>9} {'KV tokens':>11} {'conc@max':>8} "
        f"{'conc@wl':>7} {'batch':>6} {'TTFT ms':>8} {'TPOT ms':>8} {'tok/s':>9} {'tok/s/GPU':>9}",
    ]
    for i, r in enumerate([r for r in res["layouts"] if r["fits"]][:top], 1):
        lines.append(
            f"{i:>3} {r['name']:<26} {r['kv_bytes_per_token']:>9,.0f} {r['kv_tokens']:>11,} "
            f"{r['max_concurrency']:>8,} {r['concurrency_at_workload']:>7,} "
            f"{r['batch_per_instance']:>6.3g} {r['ttft_s'] * 1e3:>8.3g} {r['tpot_s'] * 1e3:>8.3g} "
            f"{r['tokens_per_s']:>9,.0f} {r['tokens_per_s_per_gpu']:>9,.0f}"
            + ("" if r["meets_load"] else "  (overloaded)")
        )
    for r in [r for r in res["layouts"] if not r["fits"]]:
        lines.append(f"  does not fit: {r['name']}, because {r['why_not']}")
    lines.append("recommendation: " + res["recommendation"])
    return "\n".join(lines)


def run_serve(args: argparse.Namespace) -> int:
    """``llmlab plan --serve`` (and ``--articles``, ``--serve --calibrate``)."""
    if args.articles:
        from llmlab.planner.articles import article_figures, format_articles

        figs = article_figures()
        print(format_articles(figs))
        _write(args.json, figs)
        return 0
    from llmlab.planner.serve_api import plan_serve
    from llmlab.planner.serve_spec import ServeWorkload

    w = ServeWorkload(
        args.prompt_len,
        args.output_len,
        args.max_model_len,
        args.concurrency,
        args.request_rate,
        args.weight_dtype,
        args.kv_dtype,
        args.block_size,
        args.gpu_memory_utilization,
        args.max_num_seqs,
        args.max_num_batched_tokens,
    )
    shape = dict(
        num_layers=args.num_layers,
        hidden=args.hidden_size,
        heads=args.num_heads,
        kv_heads=args.num_kv_heads,
        vocab=args.vocab_size or 32000,
    )
    if args.calibrate:
        from llmlab.planner.serve_validate import calibrate_serving, format_serve_validation, validate_serving

        here = calibrate_serving()
        print(
            f"calibrated this machine: memory bandwidth {here['hbm_bandwidth'] / 1e9:.1f} GB/s, "
            f"{here['flop_rate'] / 1e9:.1f} GFLOP/s; engine costs {here['overhead_s'] * 1e3:.2f} ms a step + "
            f"{here['per_seq_s'] * 1e3:.2f} ms a sequence"
        )
        v = validate_serving(here)
        print(format_serve_validation(v))
        _write(args.json, v)
        return 0
    if args.validate:
        raise ValueError("--validate trains layouts; with --serve use --calibrate")
    res = plan_serve(
        args.model,
        params=args.params,
        config=args.config,
        cluster=args.cluster,
        num_gpus=args.num_gpus,
        workload=w,
        cluster_overrides=_overrides(args),
        hbm_bandwidth=None if args.hbm_bw_gb_s is None else args.hbm_bw_gb_s * 1e9,
        gpu_memory_gb=args.gpu_memory_gb,
        gpus_per_node=args.gpus_per_node,
        **shape,
    )
    print(format_serve_table(res, args.top))
    _write(args.json, res)
    return 0 if any(r["fits"] for r in res["layouts"]) else 1


def _overrides(args: argparse.Namespace) -> dict:
    """The training planner's cluster flags that the serving model uses too (FLOP/s for prefill
    and compute-bound decode; link bandwidth and latency for TP's all-reduces)."""
    from llmlab.planner.cluster import GB, cluster_preset

    kw: dict = {}
    for flag, field, scale in (
        ("achievable_fraction", "achievable_fraction", 1),
        ("intra_bw_gb_s", "intra_bandwidth", GB),
        ("inter_bw_gb_s", "inter_bandwidth", GB),
        ("intra_latency_us", "intra_latency", 1e-6),
        ("inter_latency_us", "inter_latency", 1e-6),
    ):
        if getattr(args, flag, None) is not None:
            kw[field] = getattr(args, flag) * scale
    if getattr(args, "peak_tflops", None) is not None:
        peak = dict(cluster_preset(args.cluster).peak_flops)
        kw["peak_flops"] = peak | {d: args.peak_tflops * 1e12 for d in ("bf16", "fp16")}
    return kw


def _write(path: str | None, obj: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, default=str)
        print(f"written to {path}")
