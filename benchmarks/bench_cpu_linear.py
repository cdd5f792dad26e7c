"""The engine's linear layers on CPU: ``F.linear`` against the packed path, side by side in one run.

    PYTHONPATH=$PWD python benchmarks/bench_cpu_linear.py                        # this CPU's paths
    LLMLAB_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        PYTHONPATH=$PWD python benchmarks/bench_cpu_linear.py --dtypes bf16      # as an AVX2-only CPU

For each dtype and row count, one decoder layer's products at SmolLM2-135M's shapes (fused q/k/v
960 x 576, o_proj 576 x 576, fused gate/up 3,072 x 576, down_proj 576 x 1,536) and, at up to 64
rows (the engine multiplies only each sequence's last position by it), the lm_head (49,152 x 576),
each timed as ``F.linear`` on the row-major weight and as :func:`llmlab.kernels.cpu_linear.linear`
on the weight :func:`~llmlab.kernels.cpu_linear.pack` prepared (the path it took is printed:
``onednn``, ``onednn-fp32`` where oneDNN cannot pack the dtype and the weight is widened to fp32
(``F.linear`` below ``WIDENED_MIN_ROWS`` rows, or ``WIDENED_MIN_ROWS_PANELS`` with fp32 panels), or
``aten``; the AMX tiles or panels where the CPU has them). Each round times both in turn; the
minimum over ``--rounds`` rounds is reported (ms), with the speed-up and the largest difference of
the packed result from ``F.linear``'s, in units of the dtype's epsilon times the output's scale.
Prints the CPU flags, the level llmlab chose by, ``ONEDNN_MAX_CPU_ISA``, the thread count and the
load average.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from llmlab.kernels import cpu_isa, cpu_linear

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LAYER = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down_proj": (576, 1536)}
LM_HEAD = {"lm_head": (49152, 576)}


def ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def row(dtype: torch.dtype, rows: int, shapes: dict, rounds: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    ws = {k: (torch.randn(o, i, generator=g) * 0.02).to(dtype) for k, (o, i) in shapes.items()}
    xs = {k: torch.randn(rows, i, generator=g).to(dtype) for k, (o, i) in shapes.items()}
    for w in ws.values():
        cpu_linear.pack(w)
    aten = lambda: [F.linear(xs[k], w) for k, w in ws.items()]  # noqa: E731
    packed = lambda: [cpu_linear.linear(xs[k], w) for k, w in ws.items()]  # noqa: E731
    diff = max(  # (also the warm-up of both)
        ((p.float() - a.float()).abs().max() / (a.float().abs().max() * torch.finfo(dtype).eps)).item()
        for p, a in zip(packed(), aten())
    )
    t_aten, t_packed = [], []
    for _ in range(rounds):  # alternating: machine load falls on both alike
        t_aten.append(ms(aten))
        t_packed.append(ms(packed))
    w0 = next(iter(ws.values()))
    extra = "amx" if hasattr(w0, "_amx") else "panels" if hasattr(w0, "_panels") else ""
    how = cpu_linear.path(dtype) + (f" ({extra})" if extra and rows <= 64 else "")
    few = cpu_linear.WIDENED_MIN_ROWS_PANELS if extra == "panels" else cpu_linear.WIDENED_MIN_ROWS
    if cpu_linear.path(dtype) == "onednn-fp32" and rows < few:
        how = f"aten (< {few} rows)"
    return {"aten": min(t_aten), "packed": min(t_packed), "path": how, "diff_eps": diff}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated: fp32, bf16, fp16")
    p.add_argument("--rows", default="1,16,64,1024", help="comma-separated row counts (tokens in the step)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        p.error(f"--dtypes: {bad} not among {sorted(DTYPES)}")
    rows = [int(r) for r in args.rows.split(",")]
    if any(r < 1 for r in rows) or args.rounds < 1:
        p.error("--rows and --rounds must be positive")
    flags = sorted(f for f in cpu_isa.cpu_flags() if f.startswith(("avx", "amx", "fma")))
    la = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"CPU level {cpu_isa.cpu_isa()} (flags: {' '.join(flags)}); ONEDNN_MAX_CPU_ISA="
          f"{os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); load average {la}")
    print(f"{'dtype':5} {'products':10} {'rows':>5} {'path':22} {'F.linear ms':>12} {'packed ms':>10} "
          f"{'speed-up':>8} {'max diff (eps)':>14}")
    for name in dtypes:
        for n in rows:
            for what, shapes in (("layer", LAYER), ("lm_head", LM_HEAD)):
                if what == "lm_head" and n > 64:
                    continue
                r = row(DTYPES[name], n, shapes, args.rounds)
                print(f"{name:5} {what:10} {n:5d} {r['path']:22} {r['aten']:12.2f} {r['packed']:10.2f} "
                      f"{r['aten'] / r['packed']:7.2f}x {r['diff_eps']:14.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
