"""What ``logprobs`` add to a streamed request, per token, as the request grows (issue 37).

One ``llmlab serve`` app on a thread of this process (the shipped model's shape, random weights,
a 1024-token context); for each length L one streamed request of ``--n`` sequences generating L
tokens each (``ignore_eos``), with ``logprobs: 5`` and without; the overhead per token is
``(t_logprobs - t_plain) / L`` (ms per generated position, the batch's step). ``t`` is the CPU
time of this process (server, engine and client all run in it, torch on one thread), which other
work on a shared machine does not inflate as it does wall time; wall times are printed too. Each logprob entry
is made once, when its token is sampled, and each streamed chunk carries only its new tokens' entries,
so the overhead stays flat in L; before, every step rebuilt the entries of every earlier token
and the overhead grew with L (1.9 -> 14.7 ms from 50 to 400 tokens, 64 sequences).

    PYTHONPATH=$PWD python benchmarks/bench_logprobs.py                  # ~3 min on 2 cores
    PYTHONPATH=$PWD python benchmarks/bench_logprobs.py --lengths 50,800 --n 64 --json out.json

Each measurement is the fastest of ``--repeats`` runs (plain and logprobs runs take turns). On a
shared machine timings move by tens of percent: read the trend across lengths, not one cell.
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.request

import torch

from llmlab.model.config import PRESETS
from llmlab.serve import start_server


def _timed_stream(url: str, body: dict) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) to read the whole streamed response."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    c0, t0 = time.process_time(), time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for _ in r:
            pass
    return time.process_time() - c0, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="50,100,200,400,800", help="tokens per sequence")
    p.add_argument("--n", type=int, default=16, help="sequences per request (default 16)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    config = PRESETS["shakespeare"].replace(max_position_embeddings=1024)
    blocks = args.n * (max(lengths) + 32) // 16 + 16
    rows = []
    with start_server(config, served_model_name="m", max_num_seqs=max(64, args.n), max_n=args.n,
                      num_gpu_blocks=blocks, block_size=16, device=args.device) as s:
        url = s.url + "/v1/completions"
        base = {"model": "m", "prompt": "ROMEO:", "n": args.n, "temperature": 1.0, "seed": 0,
                "ignore_eos": True, "stream": True}
        _timed_stream(url, {**base, "max_tokens": 16, "logprobs": 5})           # warm-up
        for L in lengths:
            best = {"plain": float("inf"), "logprobs": float("inf")}
            wall = dict(best)
            for _ in range(args.repeats):
                for kind, extra in (("plain", {}), ("logprobs", {"logprobs": 5})):
                    cpu, t = _timed_stream(url, {**base, "max_tokens": L, **extra})
                    best[kind], wall[kind] = min(best[kind], cpu), min(wall[kind], t)
            over = (best["logprobs"] - best["plain"]) / L * 1e3
            rows.append({"tokens": L, "plain_cpu_s": best["plain"], "logprobs_cpu_s": best["logprobs"],
                         "plain_wall_s": wall["plain"], "logprobs_wall_s": wall["logprobs"],
                         "overhead_ms_per_token": over,
                         "plain_ms_per_token": best["plain"] / L * 1e3})
            print(f"L={L:4d}  CPU s: plain {best['plain']:7.2f} ({best['plain'] / L * 1e3:6.2f} ms/token)"
                  f"  logprobs {best['logprobs']:7.2f}  overhead {over:6.2f} ms/token"
                  f"   (wall s: {wall['plain']:.2f}, {wall['logprobs']:.2f})", flush=True)
    first, last = rows[0], rows[-1]
    ratio = (f"{last['overhead_ms_per_token'] / first['overhead_ms_per_token']:.2f}x"
             if first["overhead_ms_per_token"] > 0 else "n/a (no overhead measured at the shortest)")
    print(f"overhead per token, {last['tokens']} / {first['tokens']} tokens: {ratio} (flat: ~1x; "
          f"rebuilding every earlier token's entries at each step: ~{last['tokens'] / first['tokens']:.0f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
