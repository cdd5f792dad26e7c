"""``llmlab.plan_serve(...)`` (``llmlab plan --serve``): every TP x PP x instances layout of a
model for serving on a cluster, ranked, with the recommendation in the source articles' terms
("a 7B model: add instances rather than tensor or pipeline parallelism"; a model too large for
one GPU: tensor parallelism inside a node)."""

from __future__ import annotations

from pathlib import Path

from llmlab.planner.cluster import GB, ClusterSpec, cluster_preset
from llmlab.planner.serve_cost import HBM_BANDWIDTH, evaluate_serving
from llmlab.planner.serve_spec import ServeModel, ServeWorkload, serve_model


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _rank_key(r: dict) -> tuple:
    if not r["fits"]:
        return (1, 0, 0.0, 0.0)
    # fits and carries the load first; then output tokens/s per GPU (to 1 %), then lower TPOT
    return (0, not r["meets_load"], -float(f"{r['tokens_per_s_per_gpu']:.3g}"), r["tpot_s"])


def recommend(rows: list[dict], model: ServeModel, cluster: ClusterSpec) -> str:
    """One paragraph: instances against TP when one GPU holds the model, else the smallest TP
    inside a node that fits (the articles' rules, with this plan's numbers)."""
    fit = [r for r in rows if r["fits"]]
    if not fit:
        return f"no layout serves {model.name} on {cluster.num_gpus} GPUs: {rows[0]['why_not']}"
    best = fit[0]
    solo = [r for r in fit if r["tp"] == 1 and r["pp"] == 1]
    sharded = [r for r in fit if r["tp"] > 1 and r["pp"] == 1] or [r for r in fit if r["tp"] * r["pp"] > 1]
    if solo and sharded:
        s, t = solo[0], sharded[0]
        verdict = (
            "add instances rather than tensor or pipeline parallelism"
            if s is best or s["tokens_per_s_per_gpu"] >= t["tokens_per_s_per_gpu"]
            else f"at this load {t['name']} beats instances: {s['batch_per_instance']:.3g} sequences "
            f"per GPU leave decode memory-bound and TP shares each step's weight reads over its "
            f"GPUs; instances win once the GPUs are busy (compute-bound or at max-num-seqs)"
        )
        return (
            f"{model.name} fits one GPU ({s['memory']['weights'] / GB:.1f} GB of weights, "
            f"{s['max_concurrency_per_instance']} sequences of max-model-len per GPU): "
            f"{verdict}. {s['name']}: {s['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, TPOT "
            f"{s['tpot_s'] * 1e3:.1f} ms; with tensor parallelism {t['name']}: "
            f"{t['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, TPOT {t['tpot_s'] * 1e3:.1f} ms "
            f"(tensor parallelism buys latency, not throughput per GPU)."
        )
    if solo:
        s = solo[0]
        return (
            f"{model.name} fits one GPU ({s['memory']['weights'] / GB:.3g} GB of weights, "
            f"{s['max_concurrency_per_instance']} sequences of max-model-len per GPU): run one "
            f"instance per GPU ({s['name']}: {s['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, "
            f"TPOT {s['tpot_s'] * 1e3:.3g} ms)."
        )
    smallest = min(fit, key=lambda r: (r["tp"] * r["pp"], r["pp"]))
    inside = smallest["tp"] <= cluster.gpus_per_node
    return (
        f"{model.name} does not fit one GPU: the smallest instance that serves it is "
        f"{smallest['tp'] * smallest['pp']} GPUs ({smallest['name']}); keep tensor parallelism "
        f"{'inside a node' if inside else 'as small as possible'} (its all-reduces run twice per "
        f"layer and step), add pipeline stages or instances across nodes. Best: {best['name']}, "
        f"{best['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, TPOT {best['tpot_s'] * 1e3:.1f} ms, "
        f"{best['max_concurrency']} sequences of max-model-len in all."
    )


def plan_serve(
    model: str | ServeModel | None = None,
    *,
    params: float | None = None,
    config: str | Path | None = None,
    cluster: ClusterSpec | str = "a800",
    num_gpus: int = 8,
    workload: ServeWorkload | None = None,
    hbm_bandwidth: float | None = None,
    kv_budget_bytes: float | None = None,
    gpu_memory_gb: float | None = None,
    gpus_per_node: int | None = None,
    cluster_overrides: dict | None = None,
    **shape: int | None,
) -> dict:
    """Rank every TP x PP x instances layout of a model for serving.

    Args:
        model / params / config: as :func:`llmlab.plan` (a preset of
            :data:`~llmlab.planner.serve_spec.SERVE_MODELS` too, or a config.json with GQA,
            ``head_dim`` and sliding windows).
        cluster: a node preset (a100, a800, h100, h200) or a :class:`ClusterSpec`;
            ``gpu_memory_gb``, ``gpus_per_node`` override the preset's.
        workload: the engine settings and requests (:class:`ServeWorkload`).
        hbm_bandwidth: bytes/s per GPU (default: the preset's data sheet; required otherwise).
        kv_budget_bytes: the KV cache's bytes per GPU given directly (llmlab's engine's
            ``kv_cache_memory_bytes``) instead of what memory leaves after weights and activations.
        cluster_overrides: other :class:`ClusterSpec` fields for a preset (``peak_flops``,
            ``achievable_fraction``, bandwidths, latencies).

    Returns:
        ``{"model", "cluster", "workload", "layouts": [...], "recommendation"}`` (bytes, seconds).

    Raises:
        ValueError: a bad model, workload or cluster value, named by its flag.
    """
    m = serve_model(model, params, config, **shape)
    if hbm_bandwidth is not None and not hbm_bandwidth > 0:
        raise ValueError(f"--hbm-bw-gb-s must be > 0, got {hbm_bandwidth / 1e9:g}")
    if gpu_memory_gb is not None and not gpu_memory_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be > 0, got {gpu_memory_gb}")
    if isinstance(cluster, str):
        over = {
            k: v
            for k, v in (
                ("gpu_memory_bytes", gpu_memory_gb and gpu_memory_gb * GB),
                ("gpus_per_node", gpus_per_node),
            )
            if v
        }
        if "gpus_per_node" not in over and num_gpus < 8:
            over["gpus_per_node"] = num_gpus
        hbm = hbm_bandwidth or HBM_BANDWIDTH.get(cluster)
        cluster = cluster_preset(cluster, num_gpus, **over, **(cluster_overrides or {}))
    else:
        hbm = hbm_bandwidth or HBM_BANDWIDTH.get(cluster.name)
    cluster = cluster.validate()
    if not hbm or hbm <= 0:
        raise ValueError("--hbm-bw-gb-s must be given (> 0) for a cluster without a preset")
    w = (workload or ServeWorkload()).validate().resolved(m)
    n = cluster.num_gpus
    rows = [
        evaluate_serving(m, w, tp, pp, n // (tp * pp), cluster, hbm, kv_budget_bytes)
        for tp in _divisors(n)
        for pp in _divisors(n // tp)
    ]
    rows.sort(key=_rank_key)
    return {
        "model": m.to_dict(),
        "cluster": cluster.to_dict() | {"hbm_bandwidth": hbm},
        "workload": vars(w),
        "layouts": rows,
        "recommendation": recommend(rows, m, cluster),
        "units": {"memory": "bytes", "time": "seconds", "GB": GB},
    }
