"""Predicted seconds of one training step of a layout: compute, exposed communication, bubble.

* Compute: ``(6·N_active + 12·L·h·s)`` FLOPs per token (:func:`llmlab.metrics.throughput.
  training_flops_per_token`), ``4/3`` of it with full recomputation (one more forward), shared
  evenly by the GPUs, at :func:`flop_rate` (peak × achievable fraction, or the calibrated rate
  of a matmul of this micro-batch's size).
* Communication, each collective by :func:`llmlab.formulas.communication.collective_time` on
  the link its group crosses (:meth:`ClusterSpec.link`, group span = how many consecutive GPUs
  it covers in the tp-cp-dp-pp order):
  tensor parallelism (:func:`~llmlab.formulas.communication.tp_block_comm_bytes` per layer and
  micro-batch, forward again when recomputing; on the critical path, never overlapped);
  expert all-to-alls (dispatch and combine, forward and backward; not overlapped); ring
  attention's K/V passing (overlapped with the attention it feeds; what exceeds it is
  exposed); pipeline sends of activations and their gradients (``p2p_time``, exposed);
  gradient reduction of DDP/ZeRO-1/2 (:func:`~llmlab.formulas.communication.
  zero_comm_bytes_per_step`) overlapped with the last micro-batch's backward, ZeRO-1/2's
  parameter all-gather after the optimizer step exposed, ZeRO-3's per-micro-batch gathers
  overlapped with that micro-batch's forward and backward. "Overlapped" means only the excess
  over the compute shows, on a cluster with ``overlap=True`` (GPUs); a calibrated CPU machine
  has ``overlap=False`` (gloo's collectives run on the cores the compute needs).
* Bubble: :func:`llmlab.formulas.pipeline.pipeline_bubble_time` of a stage's work.
"""

from __future__ import annotations

import math

from llmlab.formulas.communication import (
    collective_time,
    p2p_time,
    tp_block_comm_bytes,
    tp_step_comm_bytes,
    zero_comm_bytes_per_step,
)
from llmlab.formulas.memory import dtype_bytes
from llmlab.formulas.pipeline import pipeline_bubble_time
from llmlab.metrics.throughput import training_flops_per_token
from llmlab.planner.memory import rank_params

BUCKET_BYTES = 25 * 2**20  # DDP's default gradient bucket


def flop_rate(cluster, dtype: str, matmul_flops: float) -> float:
    """FLOP/s one GPU reaches: the calibrated table (log-log interpolation in the FLOPs of one
    matmul, clamped at its ends) when there is one, else peak × achievable fraction."""
    links = cluster.op_links or {}
    table = links.get("model") or links.get("matmul")
    if not table:
        return cluster.peak(dtype) * cluster.achievable_fraction
    pts = sorted(table)
    x = math.log(max(matmul_flops, 1.0))
    if x <= math.log(pts[0][0]):
        return pts[0][1]
    for (f0, r0), (f1, r1) in zip(pts, pts[1:]):
        if x <= math.log(f1):
            w = (x - math.log(f0)) / (math.log(f1) - math.log(f0))
            return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
    return pts[-1][1]


def _exposed(comm: float, compute: float, cluster) -> float:
    """What of ``comm`` seconds shows beside ``compute`` it overlaps with: the excess on a
    cluster that overlaps (GPUs: collectives run on their own engines), all of it otherwise
    (CPU ranks under gloo: the collective uses the same cores)."""
    return max(0.0, comm - compute) if cluster.overlap else comm


def _coll(cluster, op, nbytes, n, span, calls=1):
    if n == 1 or nbytes == 0:
        return 0.0
    lat, bw = cluster.link(span, op)
    return calls * collective_time(op, nbytes / calls, n, bw, lat)


def compute_times(model, lay, workload, cluster) -> dict:
    """``{"compute", "forward_mb", "backward_mb"}`` seconds on one GPU."""
    b = workload.global_batch_size // (lay.dp * lay.num_microbatches)
    s = workload.seq_len // lay.cp
    ffn = model.top_k * model.moe_ffn if model.num_experts else model.ffn
    rate = flop_rate(cluster, workload.dtype, 2 * b * s * model.hidden * ffn / lay.tp)
    fpt = training_flops_per_token(model.active_params(), model.num_layers, model.hidden, workload.seq_len)
    base = workload.global_batch_tokens * fpt / lay.num_gpus / rate
    fwd_mb = base / 3 / lay.num_microbatches
    bwd_mb = 2 * fwd_mb + (fwd_mb if lay.recompute == "full" else 0.0)
    return {
        "compute": (fwd_mb + bwd_mb) * lay.num_microbatches,
        "forward_mb": fwd_mb,
        "backward_mb": bwd_mb,
        "flop_rate": rate,
    }


def tp_time(model, lay, workload, cluster) -> float:
    """Tensor-parallel collectives of one step (all exposed)."""
    if lay.tp == 1:
        return 0.0
    db = dtype_bytes(workload.dtype)
    b = workload.global_batch_size // (lay.dp * lay.num_microbatches)
    s, layers = workload.seq_len // lay.cp, model.num_layers // lay.pp
    t = 0.0
    block = tp_block_comm_bytes(b, s, model.hidden, lay.tp, lay.sequence_parallel, db)
    for phase, calls in block.items():
        again = 2 if phase == "forward" and lay.recompute == "full" else 1
        for op, (n, x) in calls.items():
            t += again * layers * n * _coll(cluster, op, x, lay.tp, lay.tp)
    step = tp_step_comm_bytes(b, s, model.hidden, layers, lay.tp, lay.sequence_parallel, db)
    for op, total in step.items():  # embedding, LM head, cross-entropy: what the blocks leave
        in_blocks = layers * sum(n * x for ph in block.values() for o, (n, x) in ph.items() if o == op)
        t += _coll(cluster, op, total - in_blocks, lay.tp, lay.tp)
    return t * lay.num_microbatches


def moe_cp_times(model, lay, workload, cluster, attn_fwd_mb: float) -> tuple[float, float]:
    """(expert all-to-all seconds, exposed ring-attention seconds) of one step."""
    db = dtype_bytes(workload.dtype)
    b = workload.global_batch_size // (lay.dp * lay.num_microbatches)
    s, layers, m = workload.seq_len // lay.cp, model.num_layers // lay.pp, lay.num_microbatches
    ep = 0.0
    if lay.ep > 1:
        x = b * s * model.top_k * model.hidden * db // (lay.tp if lay.sequence_parallel else 1)
        ep = 4 * layers * m * _coll(cluster, "all_to_all", x, lay.ep, lay.tp * lay.cp * lay.ep)
    cp = 0.0
    if lay.cp > 1:
        kv = 2 * b * s * model.kv_heads * model.head_dim * db
        lat, bw = cluster.link(lay.tp * lay.cp, "all_gather")
        ring = (lay.cp - 1) * p2p_time(kv, bw, lat)
        cp = (
            layers * m * (_exposed(ring, attn_fwd_mb, cluster) + _exposed(2 * ring, 2 * attn_fwd_mb, cluster))
        )
    return ep, cp


def pp_time(model, lay, workload, cluster) -> float:
    """Pipeline sends of one step on one rank: activation forward, gradient back, per chunk."""
    if lay.pp == 1:
        return 0.0
    b = workload.global_batch_size // (lay.dp * lay.num_microbatches)
    x = b * workload.seq_len // lay.cp * model.hidden * dtype_bytes(workload.dtype)
    x //= lay.tp if lay.sequence_parallel else 1
    lat, bw = cluster.link(lay.num_gpus, "p2p")
    return 2 * lay.virtual_stages * lay.num_microbatches * p2p_time(x, bw, lat)


def dp_time(model, lay, workload, cluster, fwd_mb: float, bwd_mb: float) -> float:
    """Exposed seconds of the DDP/ZeRO collectives over the ``dp·cp`` gradient group."""
    n = lay.dp * lay.cp
    if n == 1:
        return 0.0
    dense, expert = rank_params(model, lay, "last")
    span, m = lay.tp * lay.cp * lay.dp, lay.num_microbatches
    exposed = 0.0
    for count, group in ((dense, n), (expert, n // lay.ep)):
        if not count or group == 1:
            continue
        pay = zero_comm_bytes_per_step(count, lay.zero, group, workload.dtype)["payload"]
        calls = lambda nbytes: max(1, math.ceil(nbytes / BUCKET_BYTES))
        if lay.zero == 3:  # per micro-batch, one gather/reduce per layer (+ embedding, head)
            units = model.num_layers // lay.pp + 2
            ag = _coll(cluster, "all_gather", pay["all_gather"] / 2, group, span, units)
            rs = _coll(cluster, "reduce_scatter", pay["reduce_scatter"], group, span, units)
            exposed += m * (_exposed(ag, fwd_mb, cluster) + _exposed(ag + rs, bwd_mb, cluster))
            continue
        op = "all_reduce" if lay.zero == 0 else "reduce_scatter"
        nbytes = pay[op]
        grad = _coll(cluster, op, nbytes, group, span, calls(nbytes))
        if lay.zero == 2:  # gradients are sharded: reduced after every micro-batch
            exposed += (m - 1) * _exposed(grad, bwd_mb, cluster)
        exposed += _exposed(grad, bwd_mb, cluster)
        if lay.zero in (1, 2):
            exposed += _coll(cluster, "all_gather", pay["all_gather"], group, span, calls(pay["all_gather"]))
    return exposed


def step_time(model, lay, workload, cluster) -> dict:
    """Seconds of one step: ``{"step_time_s", "compute_s", "exposed_comm_s", "bubble_s",
    "comm_s": {"tp", "ep", "cp", "pp", "dp"}, "flop_rate"}``."""
    c = compute_times(model, lay, workload, cluster)
    attn_share = (
        4
        * workload.seq_len
        * model.hidden
        / (6 * model.active_params() / model.num_layers + 4 * workload.seq_len * model.hidden)
    )
    ep, cp = moe_cp_times(model, lay, workload, cluster, c["forward_mb"] * attn_share)
    comm = {
        "tp": tp_time(model, lay, workload, cluster),
        "ep": ep,
        "cp": cp,
        "pp": pp_time(model, lay, workload, cluster),
        "dp": dp_time(model, lay, workload, cluster, c["forward_mb"], c["backward_mb"]),
    }
    stage_work = c["compute"] + comm["tp"] + comm["ep"] + comm["cp"] + comm["pp"]
    bubble = pipeline_bubble_time(stage_work, lay.pp, lay.num_microbatches, lay.virtual_stages)
    exposed = sum(comm.values())
    total = c["compute"] + exposed + bubble
    solo = (cluster.op_links or {}).get("solo_speedup", 1.0)
    if solo > 1 and lay.pp > 1:  # ranks share cores: an idle stage lends its core to the others
        fast = c["compute"] / solo + stage_work - c["compute"]
        bubble = pipeline_bubble_time(fast, lay.pp, lay.num_microbatches, lay.virtual_stages)
        total = max(c["compute"] + exposed, fast + bubble + comm["dp"])
        bubble = max(0.0, total - c["compute"] - exposed)
    return {
        "step_time_s": total,
        "compute_s": c["compute"],
        "exposed_comm_s": exposed,
        "bubble_s": bubble,
        "comm_s": comm,
        "flop_rate": c["flop_rate"],
    }
