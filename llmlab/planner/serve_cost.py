"""The serving cost model of one layout: TP x PP ranks per instance, ``replicas`` instances.

Per GPU of an instance (docs/planner.md, "Serving"): weights ``N·bytes / (tp·pp)``; the KV pool
``gpu_memory_utilization x memory - weights - profile activations`` in blocks
(:mod:`llmlab.formulas.serving`); the batch an instance runs (the workload's concurrency shared
by the replicas, or the requests a rate keeps in flight by Little's law, or all that fit, at most
``max_num_seqs``); a decode *tick* (one micro-batch of ``batch / pp`` sequences through one
stage) at the memory roofline plus TP's two all-reduces per layer; TPOT = pp ticks; TTFT = the
prompt's prefill FLOPs at the achievable FLOP/s, stage after stage.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from llmlab.formulas.communication import p2p_time, ring_all_reduce_time
from llmlab.formulas.serving import (
    blocks_for,
    decode_flops,
    decode_step_time,
    kv_bytes_per_token,
    kv_pool_blocks,
    max_concurrency,
    prefill_flops,
    profile_activation_bytes,
    serve_dtype_bytes,
)

# HBM bandwidth per GPU, bytes/s (data sheets: A100/A800 80GB SXM 2.039 TB/s, H100 SXM 3.35 TB/s,
# H200 4.8 TB/s).
HBM_BANDWIDTH = {"a100": 2.039e12, "a800": 2.039e12, "h100": 3.35e12, "h200": 4.8e12}


def _memory(m: Any, w: Any, tp: int, pp: int, cluster: Any, kv_budget_bytes: float | None) -> dict:
    wb = serve_dtype_bytes(w.weight_dtype) * m.num_params / (tp * pp)
    act_bytes = 4 if w.weight_dtype == "fp32" else 2
    act = profile_activation_bytes(
        w.max_num_batched_tokens, m.hidden, m.ffn, m.vocab, act_bytes, tp, w.max_num_seqs
    )
    per_token = kv_bytes_per_token(
        m.num_layers, m.kv_heads, m.head_dim, serve_dtype_bytes(w.kv_cache_dtype, "--kv-dtype"), tp, pp
    )
    budget = (
        kv_budget_bytes
        if kv_budget_bytes is not None
        else w.gpu_memory_utilization * cluster.gpu_memory_bytes - wb - act
    )
    blocks = kv_pool_blocks(budget, per_token, w.block_size)
    return {
        "weights": wb,
        "activations": act,
        "kv_budget": budget,
        "kv_bytes_per_token": per_token,
        "kv_blocks": blocks,
        "kv_tokens": blocks * w.block_size,
    }


def _tick(
    m: Any, w: Any, tp: int, pp: int, cluster: Any, hbm: float, flop_rate: float, batch: float, mem: dict
) -> dict:
    """One stage's decode step for ``batch / pp`` sequences (seconds), split by cause."""
    mb = batch / pp
    ctx = w.prompt_len + w.output_len / 2  # mean context over the decode
    full = m.num_layers - m.sliding_layers
    read_ctx = (full * ctx + m.sliding_layers * min(ctx, m.sliding_window or ctx)) / m.num_layers
    weights, per_token = mem["weights"], mem["kv_bytes_per_token"]
    kv_read = mb * read_ctx * per_token
    flops = decode_flops(m.active_params, mb, mb * read_ctx, m.num_layers, m.hidden) / (tp * pp)
    act_bytes = 4 if w.weight_dtype == "fp32" else 2
    comm = 0.0
    if tp > 1:
        lat, bw = cluster.link(tp)
        comm = 2 * math.ceil(m.num_layers / pp) * ring_all_reduce_time(mb * m.hidden * act_bytes, tp, bw, lat)
    if pp > 1:
        lat, bw = cluster.link(tp * pp, "p2p")
        comm += p2p_time(mb * m.hidden * act_bytes, bw, lat)
    t = decode_step_time(weights, kv_read, flops, hbm, flop_rate, comm)
    return {
        "tick_s": t,
        "memory_s": (weights + kv_read) / hbm,
        "compute_s": flops / flop_rate,
        "comm_s": comm,
    }


def _batch(
    w: Any, replicas: int, cap: int, tpot_of: Callable[[float], float], ttft: float
) -> tuple[float, bool]:
    """Sequences an instance runs: the concurrency shared by the replicas, the requests a rate
    keeps in flight (Little's law, iterated), or all that fit; and whether that meets the load."""
    if w.concurrency is not None:
        want = w.concurrency / replicas
        return min(want, cap), want <= cap
    if w.request_rate is None:
        return cap, True
    rate, b = w.request_rate / replicas, 1.0
    for _ in range(50):  # sequences in flight = rate x latency; a step costs at least one sequence's
        b = min(cap, rate * (ttft + (w.output_len - 1) * tpot_of(max(b, 1.0))))
    served = cap / (ttft + (w.output_len - 1) * tpot_of(cap))
    return b, served >= rate


def _no_room_for_one_sequence(mem: dict, w: Any, cluster: Any) -> str:
    """Why a layout's KV cache cannot hold one sequence of ``max_model_len`` (the ``why_not``)."""
    gb, usable = 1e9, w.gpu_memory_utilization * cluster.gpu_memory_bytes
    used = f"weights {mem['weights'] / gb:.1f} GB + activations {mem['activations'] / gb:.1f} GB"
    if mem["kv_budget"] <= 0:
        return (
            f"{used} exceed the {w.gpu_memory_utilization:g} x {cluster.gpu_memory_bytes / gb:.0f} GB "
            f"= {usable / gb:.1f} GB the engine may use per GPU"
        )
    return (
        f"{used} leave {mem['kv_budget'] / gb:.2f} GB for KV per GPU: {mem['kv_tokens']:,} "
        f"tokens, less than one sequence of max-model-len {w.max_model_len:,}"
    )


def _ttft(m: Any, w: Any, tp: int, pp: int, cluster: Any, flop_rate: float) -> float:
    """Time to first token (s): the prompt's FLOPs over ``tp*pp`` GPUs at ``flop_rate``, plus two
    ring all-reduces of the prompt's activations per layer under TP, times ``pp`` stages in turn."""
    lat, bw = cluster.link(tp)
    act_bytes = 4 if w.weight_dtype == "fp32" else 2
    stage_prefill = (
        prefill_flops(m.active_params, w.prompt_len, m.num_layers, m.hidden) / (tp * pp) / flop_rate
    )
    tp_prefill = 0.0
    if tp > 1:
        per_layer = ring_all_reduce_time(w.prompt_len * m.hidden * act_bytes, tp, bw, lat)
        tp_prefill = 2 * math.ceil(m.num_layers / pp) * per_layer
    return pp * (stage_prefill + tp_prefill)


def evaluate_serving(
    m: Any,
    w: Any,
    tp: int,
    pp: int,
    replicas: int,
    cluster: Any,
    hbm: float,
    kv_budget_bytes: float | None = None,
) -> dict:
    """One JSON-ready row (bytes, seconds, tokens/s); ``fits`` False with ``why_not`` when the
    layout cannot serve one sequence of ``max_model_len``."""
    row = {
        "name": f"TP{tp} x PP{pp} x {replicas} instance{'s' if replicas > 1 else ''}",
        "tp": tp,
        "pp": pp,
        "replicas": replicas,
        "gpus_per_instance": tp * pp,
    }
    if m.kv_heads % tp:
        return row | {"fits": False, "why_not": f"TP{tp} does not divide the {m.kv_heads} KV heads"}
    if pp > m.num_layers:
        return row | {"fits": False, "why_not": f"PP{pp} > {m.num_layers} layers"}
    mem = _memory(m, w, tp, pp, cluster, kv_budget_bytes)
    row |= {
        "memory": mem,
        "kv_bytes_per_token": mem["kv_bytes_per_token"],
        "kv_blocks": mem["kv_blocks"],
        "kv_tokens": mem["kv_tokens"],
    }
    one_seq = blocks_for(w.max_model_len, w.block_size)
    if mem["kv_blocks"] < one_seq:
        why = _no_room_for_one_sequence(mem, w, cluster)
        return row | {"fits": False, "why_not": why}
    conc_max = max_concurrency(mem["kv_blocks"], w.block_size, w.max_model_len)
    conc_wl = min(
        w.max_num_seqs, max_concurrency(mem["kv_blocks"], w.block_size, w.prompt_len + w.output_len)
    )
    rate = cluster.peak(w.weight_dtype if w.weight_dtype in ("fp32", "bf16", "fp16") else "bf16")
    flop_rate = rate * cluster.achievable_fraction
    ttft = _ttft(m, w, tp, pp, cluster, flop_rate)
    tpot_of = lambda b: pp * _tick(m, w, tp, pp, cluster, hbm, flop_rate, b, mem)["tick_s"]  # noqa: E731
    batch, meets = _batch(w, replicas, conc_wl, tpot_of, ttft)
    tick = _tick(m, w, tp, pp, cluster, hbm, flop_rate, max(batch, 1.0), mem)
    tpot = pp * tick["tick_s"]
    tps = replicas * batch / tpot
    return row | {
        "fits": True,
        "why_not": None,
        "meets_load": meets,
        "max_concurrency": conc_max * replicas,
        "max_concurrency_per_instance": conc_max,
        "concurrency_at_workload": conc_wl * replicas,
        "batch_per_instance": batch,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "decode": tick,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / (replicas * tp * pp),
    }
