"""The serving tuning knobs of the source articles, each swept side by side in one run (shipped model, CPU).

    PYTHONPATH=$PWD python benchmarks/bench_serve_knobs.py                # every knob, ~2-3 min
    PYTHONPATH=$PWD python benchmarks/bench_serve_knobs.py --knobs max_num_seqs chunked_prefill
    PYTHONPATH=$PWD python benchmarks/bench_serve_knobs.py --json knobs.json

Knobs (llmlab names; what each sweep holds fixed is in llmlab/inference/knobs.py):
  max_tokens       SamplingParams.max_tokens caps each request's natural length: natural, 64, 16, 1
  sampling         temperature / top_k: greedy, T=0.7 top_k=1, T=0.7, T=1.0, T=1.0 top_k=20
  max_model_len    LLMEngine(max_model_len=): 512 (the model's), 128, 64
  max_num_seqs     LLMEngine(max_num_seqs=): 1, 4, 16, 64 on a fixed pool of 48 blocks
  chunked_prefill  off, then enable_chunked_prefill with max_num_batched_tokens 256, 64, 32
Each setting runs ``--repeats`` times (round-robin, after a warm-up) and its fastest run is kept.
Each row prints throughput (output tokens/s), TTFT and TPOT p50/p99, peak KV usage, preemptions,
and the knob's own effect; ratios are against the first row of the knob. Timings on a shared
machine are noisy: compare rows of one run, and run twice before trusting a small difference.
``--threads 1`` (default) keeps torch to one thread: on a busy 2-core machine two OpenMP threads
made each step of this 0.85M-parameter model ~20x slower (measured, 6.5 ms vs 123 ms).
"""
from __future__ import annotations

import argparse
import json

import torch

from llmlab.inference.knobs import SWEEPS, format_row, sweep


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="shakespeare")
    p.add_argument("--knobs", nargs="+", default=list(SWEEPS), choices=list(SWEEPS))
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per setting, round-robin; the fastest is kept (noisy machines)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--json", default=None, help="write every row (without token ids) here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"model {a.model}, {a.num_requests} requests per run, device {a.device}, "
          f"torch threads {torch.get_num_threads()}")
    out = {}
    for knob in a.knobs:
        print(f"\n== {knob}")
        rows = sweep(knob, num_requests=a.num_requests, seed=a.seed, repeats=a.repeats,
                     model=a.model, device=a.device,
                     on_run=lambda r: print("  " + format_row(r), flush=True))
        base = rows[0]
        print("  vs first row: " + ", ".join(
            f"{r['label']}: throughput "
            f"x{r['throughput_tokens_per_s'] / base['throughput_tokens_per_s']:.2f}"
            f", TTFT p99 x{r['ttft_s']['p99'] / base['ttft_s']['p99']:.2f}" for r in rows[1:]))
        out[knob] = rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
