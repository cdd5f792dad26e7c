"""Serving targets of issue 10, measured side by side in one run (shipped model, CPU by default).

    PYTHONPATH=$PWD python benchmarks/bench_serve.py                 # 64 mixed-length requests
    PYTHONPATH=$PWD python benchmarks/bench_serve.py --num-requests 16 --quick

1. Memory-matched (KV bytes of a static cache of 8 sequences at the workload's longest length):
   llmlab continuous batching over the paged cache vs HF static batches of 8.   target >= 3x
2. Unconstrained: llmlab with its default cache vs HF's best static batch (8/16/32/64). >= 1x
3. KV-cache waste (share of allocated KV slots holding no token, averaged over steps):
   llmlab target <= 4%, printed beside HF's padded static cache.
The same greedy tokens are checked equal on a few requests before timing. Numbers are printed as
measured; a missed target says MISSED rather than failing the script.
"""
from __future__ import annotations

import argparse
import json
import time

from llmlab.inference.bench import bench_serve


def _row(name, r):
    return (f"  {name:26s} {r['throughput_tokens_per_s']:9.1f} tok/s   TTFT p50/p99 "
            f"{r['ttft_s']['p50']:.3f}/{r['ttft_s']['p99']:.3f} s   TPOT p50/p99 "
            f"{r['tpot_s']['p50'] * 1e3:.1f}/{r['tpot_s']['p99'] * 1e3:.1f} ms   "
            f"KV waste {r['kv_cache_waste_fraction']:6.1%}")


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="shakespeare")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--matched-batch", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=None)
    p.add_argument("--prompt-len-median", type=float, default=24.0)
    p.add_argument("--output-len-median", type=float, default=16.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write both runs here")
    args = p.parse_args(argv)
    common = dict(model=args.model, num_requests=args.num_requests, request_rate=args.request_rate,
                  baseline="hf", device=args.device, prompt_len_median=args.prompt_len_median,
                  output_len_median=args.output_len_median)

    t0 = time.perf_counter()
    matched = bench_serve(memory_matched_batch=args.matched_batch, **common)
    print(f"(memory-matched runs took {time.perf_counter() - t0:.0f} s)", flush=True)
    t0 = time.perf_counter()
    free = bench_serve(**common, check=False)
    print(f"(unconstrained runs took {time.perf_counter() - t0:.0f} s)", flush=True)
    wl = matched["workload"]
    print(f"workload: {wl['num_requests']} requests, prompt lengths {min(wl['prompt_lens'])}.."
          f"{max(wl['prompt_lens'])} (mean {sum(wl['prompt_lens']) / len(wl['prompt_lens']):.0f}), "
          f"output lengths {min(wl['output_lens'])}..{max(wl['output_lens'])} "
          f"(mean {sum(wl['output_lens']) / len(wl['output_lens']):.0f}), "
          f"max length {matched['config']['max_len']}, device {matched['config']['device']}")

    B = args.matched_batch
    m_ours, m_hf = matched["llmlab"], matched["hf"]
    r1 = m_ours["throughput_tokens_per_s"] / m_hf["throughput_tokens_per_s"]
    print(f"\n1) memory-matched: KV bytes of {B} sequences x {matched['config']['max_len']} tokens "
          f"(llmlab: {m_ours['num_gpu_blocks']} blocks of {matched['config']['block_size']})")
    print(_row("llmlab (continuous, paged)", m_ours) + f"   preemptions {m_ours['num_preemptions']}")
    print(_row(f"HF static batch {B}", m_hf))
    print(f"   throughput ratio llmlab / HF = {r1:.2f}x   (target >= 3x: {_verdict(r1 >= 3)})")

    f_ours, f_hf = free["llmlab"], free["hf"]
    r2 = f_ours["throughput_tokens_per_s"] / f_hf["throughput_tokens_per_s"]
    print("\n2) unconstrained: llmlab default cache vs HF's best static batch")
    for s in f_hf["sweep"]:
        print(f"   HF batch {s['batch_size']:3d}: {s['throughput_tokens_per_s']:9.1f} tok/s   "
              f"KV waste {s['kv_cache_waste_fraction']:.1%}")
    print(_row("llmlab (continuous, paged)", f_ours))
    print(_row(f"HF best static (batch {f_hf['batch_size']})", f_hf))
    print(f"   throughput ratio llmlab / HF best = {r2:.2f}x   (target >= 1x: {_verdict(r2 >= 1)})")

    w = m_ours["kv_cache_waste_fraction"]
    print(f"\n3) KV-cache waste: llmlab {w:.1%} (memory-matched run), {f_ours['kv_cache_waste_fraction']:.1%}"
          f" (unconstrained) vs HF padded static cache {m_hf['kv_cache_waste_fraction']:.1%} (batch {B}),"
          f" {f_hf['kv_cache_waste_fraction']:.1%} (batch {f_hf['batch_size']})"
          f"   (target llmlab <= 4%: {_verdict(w <= 0.04)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"memory_matched": matched, "unconstrained": free}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
