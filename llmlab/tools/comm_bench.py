"""``llmlab bench comm``: bandwidth of all-reduce, all-gather, reduce-scatter and all-to-all.

Bandwidth is reported the way nccl-tests defines it (``doc/PERFORMANCE.md`` of
NVIDIA/nccl-tests):

* ``size`` S: bytes of the whole buffer the collective works on (all-reduce: the tensor;
  all-gather: the gathered output; reduce-scatter: the unsharded input; all-to-all: one rank's
  send buffer). This equals the payload :mod:`llmlab.runtime.comm` counts, and the benchmark
  checks that it does.
* ``algbw = S / t`` (bytes/s), t the average time of one call (the slowest rank's).
* ``busbw = algbw · factor``, factor ``2(n-1)/n`` for all-reduce and ``(n-1)/n`` for all-gather,
  reduce-scatter and all-to-all: the bytes each rank's link must carry, so busbw is comparable
  with the hardware's link bandwidth whatever n is.

busbw is the ``bandwidth`` of the communication wall,
:func:`llmlab.formulas.communication.ring_all_reduce_time`.

Example::

    llmlab bench comm --world-size 2 --max-bytes 4M --json comm.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from llmlab.formulas.communication import COLLECTIVES as OPS, ring_wire_factor


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw ratio for ``op`` on ``n`` ranks: the ring's wire bytes per
    payload byte, :func:`llmlab.formulas.communication.ring_wire_factor`."""
    return ring_wire_factor(op, n)


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"1M"`` -> 1048576, ``"1G"``, or a plain number of bytes."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in "KMG" else t)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size in bytes (e.g. 4096, 64K, 4M)") from None
    return int(value * mult)


def default_sizes(min_bytes: int = 1024, max_bytes: int = 4 * 2**20, factor: int = 4) -> list[int]:
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(
            f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}"
        )
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def _rank_bench(ops, sizes, iters, warmup):
    """Runs on every rank: time each collective; returns a list of result dicts."""
    import torch.distributed as dist

    from llmlab.runtime import comm

    n, rank = dist.get_world_size(), dist.get_rank()
    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = []
    for op in ops:
        for size in sizes:
            count = max(n, size // 4 // n * n)  # fp32 elements, a multiple of n
            full = torch.full((count,), float(rank + 1), device=dev)
            part = torch.empty(count // n, device=dev)
            call = {
                "all_reduce": lambda: comm.all_reduce(full),
                "all_gather": lambda: comm.all_gather_into_tensor(full, part),
                "reduce_scatter": lambda: comm.reduce_scatter_tensor(part, full),
                "all_to_all": lambda: comm.all_to_all_single(part.new_empty(count), full),
            }[op]
            for _ in range(warmup):
                call()
            sync()
            dist.barrier()
            comm.COUNTER.reset()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            sync()
            t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            payload = comm.COUNTER.snapshot()[op] // iters
            t = t.to(dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # bookkeeping: the slowest rank's time
            sec = t.item()
            nbytes = count * 4
            algbw = nbytes / sec
            out.append(
                {
                    "op": op,
                    "size_bytes": nbytes,
                    "count": count,
                    "dtype": "float32",
                    "time_s": sec,
                    "algbw_GBps": algbw / 1e9,
                    "busbw_GBps": algbw * bus_factor(op, n) / 1e9,
                    "payload_bytes_counted": payload,
                }
            )
    return out


def bench_collectives(
    world_size: int = 2, ops=OPS, sizes=None, iters: int = 5, warmup: int = 2, backend: str = "auto"
) -> dict:
    """Launch ``world_size`` ranks and time every collective in ``ops`` at every size (bytes).

    Returns ``{"world_size", "backend", "results": [{"op", "size_bytes", "count", "time_s",
    "algbw_GBps", "busbw_GBps", "payload_bytes_counted"}]}`` (GB = 1e9 bytes). Raises
    ``ValueError`` for an unknown op or backend, or non-positive counts.
    """
    from llmlab.runtime.launch import launch, resolve_backend

    for op in ops:
        bus_factor(op, 2)
    if world_size < 2:
        raise ValueError(f"--world-size must be >= 2 for a collective benchmark, got {world_size}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters}, {warmup}")
    backend = resolve_backend(backend, world_size)
    sizes = list(sizes) if sizes else default_sizes()
    results = launch(_rank_bench, world_size, list(ops), sizes, iters, warmup, backend=backend)
    return {"world_size": world_size, "backend": backend, "results": results[0]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", "-n", type=int, default=2, help="ranks (processes)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated collectives")
    p.add_argument("--min-bytes", default="1K", help="smallest message (e.g. 1K)")
    p.add_argument("--max-bytes", default="4M", help="largest message (e.g. 4M, 1G on GPUs)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "gloo", "nccl"],
        help="auto: nccl if there is a GPU per rank, else gloo",
    )
    p.add_argument("--json", default=None, help="write the results here")


def run(args: argparse.Namespace) -> int:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    sizes = default_sizes(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    res = bench_collectives(args.world_size, ops, sizes, args.iters, args.warmup, args.backend)
    print(f"# {res['world_size']} ranks, backend {res['backend']}; GB/s = 1e9 bytes/s")
    print(f"# {'op':>15} {'size(B)':>12} {'time(us)':>12} {'algbw':>9} {'busbw':>9}")
    for r in res["results"]:
        print(
            f"  {r['op']:>15} {r['size_bytes']:>12} {r['time_s'] * 1e6:>12.1f} "
            f"{r['algbw_GBps']:>9.3f} {r['busbw_GBps']:>9.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"results written to {args.json}")
    return 0
