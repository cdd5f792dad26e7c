"""The C++ CPU PagedAttention on a decode step as the engine makes it: cache cold, one layer after another.

    PYTHONPATH=$PWD python benchmarks/bench_cpu_paged_attention.py                   # bf16 and fp32, 40 and 64 seqs
    PYTHONPATH=$PWD python benchmarks/bench_cpu_paged_attention.py --against HEAD~3  # and an older build, side by side
    PYTHONPATH=$PWD python benchmarks/bench_cpu_paged_attention.py --prefill --seqs 26 --ctx 36,250  # prompts instead

The engine's cache is one tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` filling
``--kv-bytes`` (1 GiB, as benchmarks/bench_vs_vllm.py gives both engines), and a decode step calls
the kernel once per layer on that layer's K and V: each call reads its layer's blocks from memory,
since the 29 other layers' calls in between have pushed them out of the caches. This script builds
that cache (SmolLM2-135M's shapes: 30 layers, 9 query heads, 3 KV heads, head_dim 64, block size
32), gives ``--seqs`` sequences one new token each over contexts drawn from ``--ctx`` (blocks drawn
at random from the pool, as a block manager hands them out after a while), and times

* ``cold``: one decode step's attention, every layer in turn (ms per layer call);
* ``hot``: layer 0's call repeated, its K/V in the caches (ms per call);

as the minimum over ``--rounds`` rounds (the machine is shared: the minimum is the least disturbed).
With ``--prefill`` the step is a prompt step instead: each sequence's whole context is its prompt
(query_len = context_len, the kernel's prompt items; bound by arithmetic rather than memory, so
``hot`` is the figure to read).
With ``--against REF`` the kernel's source at git ref ``REF`` is built too (its own extension name)
and each round times both in turn, after checking their outputs agree. Prints the CPU flags, the
build's instruction-set level, the thread count and the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
CSRC = "llmlab/kernels/csrc"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def machine() -> str:
    """CPU flags, build level, threads and load average, one line."""
    from llmlab.kernels import cpu_isa, cpu_paged_attention

    flags = sorted(f for f in cpu_isa.cpu_flags() if f.startswith(("avx", "amx", "fma")))
    la = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"CPU level {cpu_isa.cpu_isa()} (flags: {' '.join(flags)}); kernel build {cpu_paged_attention.isa()}; "
        f"{torch.get_num_threads()} thread(s); load average {la}"
    )


def build_at(ref: str) -> Callable[..., torch.Tensor]:
    """The kernel as git ref ``ref`` had it (its .cpp and headers), built with today's flags."""
    from torch.utils.cpp_extension import load

    from llmlab.kernels import cpu_build

    tmp = Path(tempfile.mkdtemp(prefix="llmlab_attn_ref_"))
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", ref, CSRC + "/"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in names:
        blob = subprocess.run(
            ["git", "show", f"{ref}:{name}"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        (tmp / Path(name).name).write_bytes(blob)
    sha = subprocess.run(
        ["git", "rev-parse", "--short", ref], cwd=ROOT, check=True, capture_output=True, text=True
    )
    mod = load(
        name=f"llmlab_paged_attention_ref_{sha.stdout.strip()}",
        sources=[str(tmp / "paged_attention_cpu.cpp")],
        extra_cflags=cpu_build.flags(),
        verbose=False,
    )
    return lambda q, k, v, t, c, ql: mod.paged_attention_cpu(q, k, v, t, c, ql, q.shape[-1] ** -0.5, -1)


def decode_step(args: argparse.Namespace, dtype: torch.dtype, seqs: int) -> dict[str, Any]:
    """The cache, block tables, contexts and each layer's queries of one decode step (of one
    prompt step with ``--prefill``: a query per cached token)."""
    L, H, Hkv, D, bs = args.layers, 9, 3, 64, 32
    num_blocks = args.kv_bytes // (L * 2 * bs * Hkv * D * dtype.itemsize)
    rng = random.Random(0)
    lo, hi = map(int, args.ctx.split(","))
    ctx = [rng.randint(lo, hi) for _ in range(seqs)]
    per_seq = [-(-c // bs) for c in ctx]
    if sum(per_seq) > num_blocks:
        raise SystemExit(f"--kv-bytes holds {num_blocks} blocks a layer: too few for {sum(per_seq)}")
    tables = torch.zeros(seqs, max(per_seq), dtype=torch.int32)
    if args.blocks == "runs":  # each sequence's blocks in a row, the sequences in random order
        start, spare = 0, num_blocks - sum(per_seq)
        for s in rng.sample(range(seqs), seqs):
            gap = rng.randint(0, min(3, spare))
            start, spare = start + gap, spare - gap
            tables[s, : per_seq[s]] = torch.arange(start, start + per_seq[s])
            start += per_seq[s]
    else:
        pool = rng.sample(range(num_blocks), sum(per_seq))
        for s, n in enumerate(per_seq):
            tables[s, :n] = torch.tensor(pool[:n])
            pool = pool[n:]
    cache = torch.empty(L, 2, num_blocks, bs, Hkv, D, dtype=dtype)
    cache.normal_(generator=torch.Generator().manual_seed(0))
    qlens = torch.tensor(ctx) if args.prefill else torch.ones(seqs, dtype=torch.long)
    q = torch.randn(L, int(qlens.sum()), H, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    return dict(cache=cache, q=q, tables=tables, ctx=torch.tensor(ctx), qlens=qlens)


def time_one(
    fn: Callable[..., torch.Tensor], step: dict[str, Any], layers: int, hot_reps: int
) -> tuple[float, float]:
    """(cold, hot) ms per layer call of ``fn`` on ``step``."""
    c, t, cl, ql, q = step["cache"], step["tables"], step["ctx"], step["qlens"], step["q"]
    t0 = time.perf_counter()
    for layer in range(layers):
        fn(q[layer], c[layer, 0], c[layer, 1], t, cl, ql)
    cold = (time.perf_counter() - t0) / layers * 1e3
    fn(q[0], c[0, 0], c[0, 1], t, cl, ql)
    t0 = time.perf_counter()
    for _ in range(hot_reps):
        fn(q[0], c[0, 0], c[0, 1], t, cl, ql)
    return cold, (time.perf_counter() - t0) / hot_reps * 1e3


def run_case(
    args: argparse.Namespace, fns: dict[str, Callable[..., torch.Tensor]], dt: str, seqs: int
) -> None:
    step = decode_step(args, DTYPES[dt], seqs)
    kv_mb = 2 * int(step["ctx"].sum()) * 3 * 64 * DTYPES[dt].itemsize / 1e6
    outs = {
        name: fn(
            step["q"][0], step["cache"][0, 0], step["cache"][0, 1], step["tables"], step["ctx"], step["qlens"]
        )
        for name, fn in fns.items()
    }
    base = outs["this"].float()
    diffs = {name: (o.float() - base).abs().max().item() for name, o in outs.items() if name != "this"}
    best = {name: [float("inf"), float("inf")] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            cold, hot = time_one(fn, step, args.layers, args.hot_reps)
            best[name] = [min(best[name][0], cold), min(best[name][1], hot)]
    for name, (cold, hot) in best.items():
        extra = f"  max|diff| vs this {diffs[name]:.1e}" if name in diffs else ""
        print(f"{dt:>5} {seqs:>5} {name:>12} {cold:>9.3f} {hot:>9.3f} {kv_mb / cold:>11.1f}{extra}")
    del step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--seqs", default="40,64", help="decode sequences, comma separated")
    p.add_argument("--ctx", default="100,250", help="context lengths drawn from [lo, hi]")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-bytes", type=int, default=1 << 30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hot-reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--against", metavar="REF", help="also time the kernel at this git ref")
    p.add_argument("--blocks", choices=("random", "runs"), default="random",
                   help="random: blocks drawn from the pool; runs: each sequence's blocks in a row")
    p.add_argument("--prefill", action="store_true", help="a prompt step: each context is a whole prompt")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from llmlab.kernels.cpu_paged_attention import paged_attention_cpu

    fns: dict[str, Callable[..., torch.Tensor]] = {"this": paged_attention_cpu}
    if args.against:
        fns[args.against] = build_at(args.against)
    print(machine())
    print(f"{'dtype':>5} {'seqs':>5} {'kernel':>12} {'cold ms':>9} {'hot ms':>9} {'cold GB/s':>11}")
    for dt in args.dtypes.split(","):
        for seqs in map(int, args.seqs.split(",")):
            run_case(args, fns, dt, seqs)
    print(machine().rsplit("; ", 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
