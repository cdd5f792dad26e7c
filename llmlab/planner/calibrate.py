"""``llmlab plan --calibrate``: this machine's numbers for the cost model, measured on its ranks.

* Matmul FLOP/s: every rank at once (so ranks sharing cores or a GPU share them as in training)
  multiplies ``[rows, hidden] @ [hidden, width]`` for the model's hidden size, MLP widths
  ``ffn/tp`` and a range of rows; the table maps the FLOPs of one matmul to FLOP/s per rank, and
  :func:`llmlab.planner.step_time.flop_rate` interpolates it.
* The model itself: forward + backward of one tensor-parallel rank's slice of the preset at
  several micro-batch sizes, every rank at once and then rank 0 alone (how much faster a rank
  runs when the others idle, as in a pipeline bubble on a machine whose ranks share cores).
* Collectives: :func:`llmlab.tools.comm_bench.bench_collectives` (``llmlab bench comm``) times
  each collective at several sizes; α and β are fitted by least squares to
  ``t = steps·α + wire/β`` (steps 2(N−1) for all-reduce, N−1 otherwise; wire = the ring's bytes
  per rank, :func:`llmlab.formulas.communication.ring_wire_factor`), per collective.

The result is a :class:`ClusterSpec` of one "node" of ``world_size`` ranks whose ``op_links``
hold the fits (``reserved_bytes = 0``: on CPU nothing is reserved).
"""

from __future__ import annotations

import time

from llmlab.formulas.communication import ring_wire_factor
from llmlab.planner.cluster import ClusterSpec


def _rank_matmuls(shapes, dtype, iters, min_s=0.05):
    import torch
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = []
    for rows, k, n in shapes:
        a, b = torch.randn(rows, k, device=dev, dtype=dt), torch.randn(k, n, device=dev, dtype=dt)
        a @ b
        sync()
        dist.barrier()
        t0, done = time.perf_counter(), 0
        while done < iters or time.perf_counter() - t0 < min_s:  # long enough to overlap ranks
            a @ b
            done += 1
            if done % 8 == 0:
                sync()
        sync()
        out.append([2.0 * rows * k * n, 2.0 * rows * k * n * done / (time.perf_counter() - t0)])
    return out


def _time_model(model, x, reps, sync):
    """The fastest of ``reps`` forward + backward passes (after one warm-up): on a loaded
    machine the minimum is the least disturbed measurement."""
    model(x, x).backward()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        model(x, x).backward()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _rank_model(mc_dict, cases, seq_len, reps):
    """Per case (tp, batch): [matmul FLOPs key, model FLOP/s all ranks at once, rank 0 alone]."""
    import torch
    import torch.distributed as dist

    from llmlab.model.config import ModelConfig
    from llmlab.model.llama import LlamaForCausalLM

    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    full = ModelConfig(**mc_dict)
    out = []
    for t, b in cases:  # one tensor-parallel rank's slice of the model: heads, kv heads, MLP / t
        mc = full.replace(
            num_attention_heads=full.num_attention_heads // t,
            num_key_value_heads=max(full.num_key_value_heads // t, 1),
            intermediate_size=full.intermediate_size // t,
            explicit_head_dim=full.head_dim,
        )
        model = LlamaForCausalLM(mc).to(dev)
        x = torch.randint(0, mc.vocab_size, (b, seq_len), device=dev)
        flops = (
            b
            * seq_len
            * (6 * mc.num_parameters() + 12 * mc.num_hidden_layers * full.hidden_size * seq_len / t)
        )
        dist.barrier()
        together = _time_model(model, x, reps, sync)
        dist.barrier()
        alone = _time_model(model, x, reps, sync) if dist.get_rank() == 0 else together
        dist.barrier()
        out.append(
            [
                2.0 * b * seq_len * full.hidden_size * full.intermediate_size / t,
                flops / together,
                flops / alone,
            ]
        )
    return out


def measure_model(
    world_size: int, mc, seq_len: int, batches=(1, 4, 16), tps=(1, 2, 4), reps: int = 3, backend: str = "auto"
) -> tuple[list, float]:
    """The model's own forward + backward FLOP/s per rank (``6N + 12·L·h·s`` per token), for
    each tensor-parallel slice and micro-batch size, every rank at once: ``([[matmul FLOPs,
    FLOP/s], ...], solo)`` where ``solo`` is how much faster one rank runs alone (> 1 when
    ranks share cores; 1 on dedicated GPUs)."""
    import dataclasses

    from llmlab.runtime.launch import launch

    cases = [(t, b) for t in tps if mc.num_attention_heads % t == 0 for b in batches]
    d = {f.name: getattr(mc, f.name) for f in dataclasses.fields(mc)}
    res = launch(_rank_model, world_size, d, cases, seq_len, reps, backend=backend)
    table = [[k, sum(r[i][1] for r in res) / len(res)] for i, (k, _, _) in enumerate(res[0])]
    solo = sorted(r[2] / r[1] for r in res[0])[len(res[0]) // 2]
    return table, max(1.0, solo)


def measure_matmul(
    world_size: int,
    hidden: int,
    widths,
    rows=(64, 256, 1024, 4096),
    dtype: str = "fp32",
    iters: int = 10,
    backend: str = "auto",
) -> list:
    """``[[flops_per_matmul, flop_per_s_per_rank], ...]``, the mean over ranks, all at once."""
    from llmlab.runtime.launch import launch

    shapes = [(r, hidden, w) for w in sorted(set(widths)) for r in rows]
    res = launch(_rank_matmuls, world_size, shapes, dtype, iters, backend=backend)
    return [[res[0][i][0], sum(r[i][1] for r in res) / len(res)] for i in range(len(shapes))]


def _memory_per_rank(backend: str, world_size: int) -> float:
    import os

    import torch

    if backend == "nccl":
        return float(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world_size


def fit_alpha_beta(results: list[dict], world_size: int) -> dict:
    """Least-squares ``{op: {"latency", "bandwidth"}}`` from ``bench_collectives`` rows."""
    out = {}
    for op in sorted({r["op"] for r in results}):
        pts = [
            (
                (2 if op == "all_reduce" else 1) * (world_size - 1),
                r["size_bytes"] * ring_wire_factor(op, world_size),
                r["time_s"],
            )
            for r in results
            if r["op"] == op
        ]
        # t = steps·α + wire·γ with γ = 1/β: 2x2 normal equations
        sxx = sum(s * s for s, _, _ in pts)
        syy = sum(w * w for _, w, _ in pts)
        sxy = sum(s * w for s, w, _ in pts)
        sxt = sum(s * t for s, _, t in pts)
        syt = sum(w * t for _, w, t in pts)
        det = sxx * syy - sxy * sxy
        alpha = (sxt * syy - syt * sxy) / det if det else 0.0
        gamma = (sxx * syt - sxy * sxt) / det if det else 0.0
        if alpha < 0 or gamma <= 0:  # keep the physical fit: α >= 0, β > 0
            alpha = max(0.0, alpha)
            gamma = max(sum(w * (t - alpha * s) for s, w, t in pts) / syy, 1e-15)
        out[op] = {"latency": alpha, "bandwidth": 1.0 / gamma}
    return out


def calibrate(
    world_size: int,
    model: str = "tiny",
    seq_len: int = 256,
    dtype: str = "fp32",
    backend: str = "auto",
    max_bytes: int = 4 * 2**20,
    quick: bool = False,
) -> ClusterSpec:
    """Measure this machine on ``world_size`` ranks; returns the calibrated cluster. The step
    time's compute uses the model's measured FLOP/s (``op_links["model"]``), which folds in
    what a bare matmul (``op_links["matmul"]``) does not: norms, attention, per-op overhead.
    Bare matmuls run in ``dtype``, the model's passes in fp32 (the trainer's CPU dtype); the
    peak for ``dtype`` is the larger. Memory per rank: the GPU's, or the RAM / ranks on CPU.
    ``quick``: fewer shapes and sizes (a test's budget). Raises ``ValueError`` under 2 ranks."""
    from llmlab.model.config import get_preset
    from llmlab.tools.comm_bench import bench_collectives, default_sizes

    if world_size < 2:
        raise ValueError(f"--calibrate needs --num-gpus >= 2 ranks, got {world_size}")
    mc = get_preset(model)
    tps, rows = ((1, 2), (256, 1024)) if quick else ((1, 2, 4), (64, 256, 1024, 4096))
    matmul = measure_matmul(
        world_size,
        mc.hidden_size,
        [mc.intermediate_size // t for t in tps],
        rows,
        dtype=dtype,
        backend=backend,
    )
    table, solo = measure_model(
        world_size, mc, seq_len, (1, 4) if quick else (1, 4, 16), tps, backend=backend
    )
    comm = bench_collectives(
        world_size,
        sizes=default_sizes(4096, max_bytes // (4 if quick else 1), 4),
        iters=3 if quick else 5,
        warmup=1 if quick else 2,
        backend=backend,
    )
    links = fit_alpha_beta(comm["results"], world_size)
    ag = links.get("all_gather", next(iter(links.values())))
    peak = max(r for _, r in matmul + table)
    return ClusterSpec(
        num_gpus=world_size,
        gpus_per_node=world_size,
        gpu_memory_bytes=_memory_per_rank(comm["backend"], world_size),
        peak_flops={dtype: peak},
        intra_bandwidth=ag["bandwidth"],
        inter_bandwidth=ag["bandwidth"],
        intra_latency=ag["latency"],
        inter_latency=ag["latency"],
        achievable_fraction=1.0,
        reserved_bytes=0,
        name=f"this machine ({comm['backend']})",
        overlap=comm["backend"] == "nccl",
        op_links=links | {"matmul": matmul, "model": table, "solo_speedup": solo, "backend": comm["backend"]},
    )
