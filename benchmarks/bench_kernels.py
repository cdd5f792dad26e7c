"""Kernels against PyTorch: attention memory against sequence length, and GPU speed.

    PYTHONPATH=$PWD python benchmarks/bench_kernels.py            # memory table (any device)
    PYTHONPATH=$PWD python benchmarks/bench_kernels.py --quick    # smaller shapes

Memory (CPU or GPU): bytes saved for backward by attention with the scores materialised
("eager", O(T²)) against FlashAttention's algorithm ("reference" in PyTorch, "triton" on GPU,
O(T)), measured with saved-tensor hooks next to the formulas; on GPU also the allocator's peak.

Speed (GPU only; prints "no GPU: skipped" on CPU): causal attention eager vs SDPA vs Triton
(TFLOP/s and fraction of the device's peak), RMSNorm eager vs F.rms_norm vs Triton and SwiGLU
eager vs Triton (GB/s and fraction of peak bandwidth), forward and forward + backward, printed
side by side with the speed-up over eager. The source articles credit FlashAttention with 3-5x.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: the interpreter is for correctness, not for timing")

from llmlab.kernels import triton_available  # noqa: E402
from llmlab.kernels.bench import (attention_memory, bench_attention, bench_rmsnorm,  # noqa: E402
                                  bench_swiglu, format_rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"

    print("== attention memory against sequence length (B=1, H=4, D=32, fp32) ==")
    seq = (256, 512, 1024) if args.quick or not gpu else (1024, 2048, 4096, 8192)
    impls = ["eager", "reference"] + (["sdpa", "triton"] if gpu and triton_available() else [])
    rows = attention_memory(seq, device=dev, impls=impls)
    for r in rows:
        r["saved/formula"] = r["saved_bytes"] / r["formula_bytes"]
    print(format_rows(rows, ["impl", "seq_len", "saved_bytes", "formula_bytes", "saved/formula",
                             "peak_bytes"]))
    by = {(r["impl"], r["seq_len"]): r["saved_bytes"] for r in rows}
    lo, hi = seq[0], seq[-1]
    print(f"growth from T={lo} to T={hi} (x{hi // lo}): eager x{by[('eager', hi)] / by[('eager', lo)]:.1f}"
          f", flash x{by[('reference', hi)] / by[('reference', lo)]:.1f}; "
          f"eager/flash at T={hi}: {by[('eager', hi)] / by[('reference', hi)]:.1f}x")

    if not gpu:
        print("\n== speed: no GPU: skipped ==")
        return 0
    if not triton_available():
        print("\n== speed: triton not installed: skipped (pip install triton) ==")
        return 0
    print(f"\n== speed on {torch.cuda.get_device_name()} (bf16) ==")
    shapes = ((2, 8, 1024, 64),) if args.quick else ((4, 16, 1024, 64), (4, 16, 4096, 64),
                                                      (1, 16, 8192, 128))
    print(format_rows(bench_attention(shapes),
                      ["impl", "shape", "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops",
                       "fwd_peak_frac", "speedup_vs_eager"]))
    cols = ["op", "impl", "shape", "fwd_ms", "fwd_bwd_ms", "fwd_gbps", "fwd_bwd_gbps",
            "fwd_peak_frac", "speedup_vs_eager"]
    rs = ((4096, 4096),) if args.quick else ((8192, 4096), (16384, 8192))
    sw = ((4096, 11008),) if args.quick else ((8192, 11008), (16384, 14336))
    print(format_rows(bench_rmsnorm(rs) + bench_swiglu(sw), cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
