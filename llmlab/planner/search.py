"""The search: every valid layout, its predicted memory and step time, ranked.

Ranking: layouts that fit first, fastest step first (ties: less memory first); then those that
do not fit, smallest memory first. Each row also carries MFU (model FLOPs 6·N + 12·L·h·s per token, without
recomputation, over peak FLOP/s), tokens/s and the days to train ``workload.token_budget``.
"""

from __future__ import annotations

from llmlab.metrics.throughput import training_flops_per_token
from llmlab.planner.layout import layouts
from llmlab.planner.memory import memory_per_gpu
from llmlab.planner.step_time import step_time


def needs(total: float, memory: float) -> str:
    """``needs 80.02 GB per GPU > 80 GB``: GB (1e9 bytes) with as many decimals (up to 6) as it
    takes for the two printed numbers to differ, as the numbers themselves do."""
    for digits in range(1, 7):
        if f"{total / 1e9:.{digits}f}" != f"{memory / 1e9:.{digits}f}":
            break
    return f"needs {total / 1e9:.{digits}f} GB per GPU > {memory / 1e9:.{digits}f} GB"


def evaluate(model, lay, workload, cluster) -> dict:
    """One JSON-ready row: the layout, its memory (bytes), step time (s) and derived rates."""
    mem = memory_per_gpu(model, lay, workload, cluster)
    st = step_time(model, lay, workload, cluster)
    fits = mem["total"] <= cluster.gpu_memory_bytes
    tps = workload.global_batch_tokens / st["step_time_s"]
    fpt = training_flops_per_token(model.active_params(), model.num_layers, model.hidden, workload.seq_len)
    peak = cluster.peak(workload.dtype) * lay.num_gpus
    row = lay.to_dict() | {
        "fits": fits,
        "why_not": None if fits else needs(mem["total"], cluster.gpu_memory_bytes),
        "memory_bytes_per_gpu": mem["total"],
        "memory": mem,
        "micro_batch_size": workload.global_batch_size // (lay.dp * lay.num_microbatches),
        "tokens_per_s": tps,
        "mfu": tps * fpt / peak,
        "days_to_train": workload.token_budget / tps / 86400,
    }
    return row | st


def search(model, workload, cluster, max_microbatches: int = 64, zero_stages=(0, 1, 2, 3)) -> list[dict]:
    """Every valid layout of ``model`` on all of ``cluster``'s GPUs, evaluated and ranked."""
    rows = [
        evaluate(model, lay, workload, cluster)
        for lay in layouts(
            model, workload, cluster.num_gpus, cluster.gpus_per_node, max_microbatches, zero_stages
        )
    ]
    rows.sort(
        key=lambda r: (not r["fits"], r["step_time_s"] if r["fits"] else 0.0, r["memory_bytes_per_gpu"])
    )
    return rows
