"""The source articles' serving and memory figures, computed (``llmlab plan --articles``).

Each figure is recomputed from the formulas with the assumptions that make it true stated, or
with the honest statement that none do:

* "max-model-len 10240 supports concurrency 128": the KV pool of Qwen2.5-72B (bf16) on one node
  of 8 A800-80GB (TP8) holds 125 sequences of 10,240 tokens at vLLM's default
  ``gpu_memory_utilization`` 0.9 and 128 at 0.915; 38 at the model's own 32,768 tokens.
* "paged KV: utilisation +300%, memory halved (72B, long sequences)": 27 requests averaging a
  quarter of a 32,768-token reservation, on Qwen2.5-72B's weights.
* "8B: activations 96 GB, total 224 GB": 32 + 32 + 64 + 96 GB; Korthikanti's activation count
  gives 96 GB at one sequence of about 3,900 tokens; no power-of-two shape gives it.
* "175B needs at least 22 A100-80GB for its parameters": its parameters need 5 (fp16) or 9 (fp32);
  22 cards hold 10 bytes per parameter; mixed-precision training states (16 bytes) need 35.
"""

from __future__ import annotations

from llmlab.formulas.activations import activation_bytes_per_layer
from llmlab.formulas.memory import model_state_bytes
from llmlab.formulas.serving import gpus_for_bytes, kv_bytes_per_token, paged_vs_contiguous
from llmlab.planner.serve_spec import SERVE_MODELS, ServeWorkload

GB = 1e9


def concurrency_10240(utilisation: float = 0.915, max_model_len: int = 10240) -> dict:
    """Sequences of ``max_model_len`` the TP8 pool of Qwen2.5-72B (bf16) holds on 8 x A800-80GB."""
    from llmlab.planner.serve_api import plan_serve

    w = ServeWorkload(
        prompt_len=1024, output_len=256, max_model_len=max_model_len, gpu_memory_utilization=utilisation
    )
    res = plan_serve("qwen2.5-72b", cluster="a800", num_gpus=8, workload=w)
    row = next(r for r in res["layouts"] if r["tp"] == 8 and r["pp"] == 1)
    return {
        "model": "qwen2.5-72b",
        "gpus": "8 x a800 (80 GB), TP8",
        "dtype": "bf16 weights and KV",
        "gpu_memory_utilization": utilisation,
        "max_model_len": max_model_len,
        "kv_tokens": row["kv_tokens"],
        "max_concurrency": row["max_concurrency"],
    }


def paged_72b(num_requests: int = 27, reserve_len: int = 32768) -> dict:
    """Contiguous against paged KV for Qwen2.5-72B (bf16, block 16): ``num_requests`` requests of
    4,096 ... 12,288 tokens (mean 8,192, a quarter of ``reserve_len``)."""
    m = SERVE_MODELS["qwen2.5-72b"]
    per_token = kv_bytes_per_token(m.num_layers, m.kv_heads, m.head_dim, 2)
    lengths = [4096 + round(8192 * i / (num_requests - 1) / 16) * 16 for i in range(num_requests)]
    out = paged_vs_contiguous(lengths, reserve_len, per_token, 16, weight_bytes=2 * m.num_params)
    return out | {
        "model": m.name,
        "num_requests": num_requests,
        "reserve_len": reserve_len,
        "mean_len": sum(lengths) / len(lengths),
        "kv_bytes_per_token": per_token,
        "weight_bytes": 2 * m.num_params,
    }


def activations_8b(target_gb: float = 96.0) -> dict:
    """The articles' 8B (Llama-3-8B's 32 layers, hidden 4096, 32 heads): Korthikanti's 16-bit
    activations, no recomputation, for power-of-two shapes, and the one-sequence length that
    gives ``target_gb``; the total 32 + 32 + 64 + 96."""
    layers, h, a = 32, 4096, 32

    def act(b: int, s: int) -> float:
        return layers * activation_bytes_per_layer(s, b, h, a)

    grid = {f"b={b} s={s}": act(b, s) for b in (1, 2, 4) for s in (1024, 2048, 4096, 8192)}
    lo, hi = 1, 65536  # smallest s with act(1, s) >= target
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if act(1, mid) < target_gb * GB else (lo, mid)
    exact = [k for k, v in grid.items() if round(v / GB) == round(target_gb)]
    states = model_state_bytes(8e9, "fp32", "adam")
    return {
        "grid_bytes": grid,
        "seq_len_for_target_at_b1": lo,
        "target_bytes": target_gb * GB,
        "power_of_two_shapes_giving_target": exact,
        "model_states": states,
        "total_bytes": states["total"] + target_gb * GB,
    }


def gpus_175b(gpu_memory_gb: float = 80.0) -> dict:
    """A100-80GB cards (decimal GB) that hold 175e9 parameters at 2, 4, 10 and 16 bytes each."""
    return {f"{b} B/param": gpus_for_bytes(175e9 * b, gpu_memory_gb * GB) for b in (2, 4, 10, 16)}


def article_figures() -> dict:
    return {
        "concurrency_10240": {
            "default_0.9": concurrency_10240(0.9),
            "at_0.915": concurrency_10240(0.915),
            "native_32768": concurrency_10240(0.915, 32768),
        },
        "paged_72b": paged_72b(),
        "activations_8b": activations_8b(),
        "gpus_175b": gpus_175b(),
    }


def format_articles(f: dict) -> str:
    c, p, a, g = f["concurrency_10240"], f["paged_72b"], f["activations_8b"], f["gpus_175b"]
    near = min(a["grid_bytes"].items(), key=lambda kv: abs(kv[1] - a["target_bytes"]))
    return "\n".join(
        [
            "1. max-model-len 10240 -> concurrency 128 (qwen2.5-72b, bf16 weights and KV, TP8 on 8 x A800-80GB):",
            f"   gpu_memory_utilization 0.9: {c['default_0.9']['max_concurrency']} sequences of 10,240 tokens; "
            f"0.915: {c['at_0.915']['max_concurrency']} ({c['at_0.915']['kv_tokens']:,} KV tokens); "
            f"at the model's 32,768: {c['native_32768']['max_concurrency']}",
            f"2. paged KV, 72B ({p['num_requests']} requests of mean {p['mean_len']:.0f} tokens, "
            f"contiguous reservation {p['reserve_len']:,}): utilisation {p['contiguous_utilisation']:.0%} -> "
            f"{p['paged_utilisation']:.0%} (+{p['utilisation_gain']:.0%}); KV "
            f"{p['contiguous_bytes'] / GB:.0f} -> {p['paged_bytes'] / GB:.0f} GB; weights + KV "
            f"{(p['weight_bytes'] + p['contiguous_bytes']) / GB:.0f} -> "
            f"{(p['weight_bytes'] + p['paged_bytes']) / GB:.0f} GB (x{p['total_ratio']:.2f})",
            f"3. 8B fp32 + Adam: states {a['model_states']['total'] / GB:.0f} GB + activations 96 GB = "
            f"{a['total_bytes'] / GB:.0f} GB; Korthikanti's 16-bit activations (Llama-3-8B shape, no "
            f"recompute) reach 96 GB at one sequence of {a['seq_len_for_target_at_b1']:,} tokens; no "
            f"power-of-two shape gives it (nearest {near[0]}: {near[1] / GB:.0f} GB)",
            "4. 175B on A100-80GB: "
            + ", ".join(f"{k} -> {v} cards" for k, v in g.items())
            + "; parameters alone (2 or 4 B) need 5 or 9, '22' is 10 B per parameter",
        ]
    )
