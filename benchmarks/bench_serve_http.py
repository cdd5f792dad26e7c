"""Scale-out over HTTP: one engine vs N data-parallel replicas vs one engine on N tensor-parallel
ranks, each behind ``llmlab serve``'s app, loaded by ``llmlab bench serve --endpoint`` at rising
request rates (shipped model; Poisson arrivals of the ShareGPT-like workload).

    PYTHONPATH=$PWD python benchmarks/bench_serve_http.py                      # ~2 min on 2 cores
    PYTHONPATH=$PWD python benchmarks/bench_serve_http.py --rates 4,16,inf --num-requests 48 --json out.json

Every set-up gets a warm-up, then the rates in order; each set-up is run ``--repeats`` times, set-ups
taking turns, and the repeat with the median throughput at the highest rate is printed, with the
ratio of its throughput to the single engine's at the same rate. Timings on a shared machine move
by tens of percent: compare rows of one run. The servers run on threads of this process (the
tensor-parallel one adds N - 1 worker processes) and are stopped at the end.
"""
from __future__ import annotations

import argparse
import json

import torch

from llmlab.serve import start_server
from llmlab.serve.load_test import bench_endpoint, parse_rates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="4,16,inf", help="request rates, comma-separated (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--size", type=int, default=2, help="replicas / tensor-parallel ranks (default 2)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rates = parse_rates(args.rates)
    setups = {"1 engine": {}, f"{args.size} replicas": {"data_parallel_size": args.size},
              f"TP {args.size}": {"tensor_parallel_size": args.size}}
    runs: dict[str, list] = {k: [] for k in setups}
    for _ in range(args.repeats):
        for name, kw in setups.items():
            with start_server("shakespeare", max_num_seqs=32, device=args.device, **kw) as s:
                bench_endpoint(s.url, [float("inf")], num_requests=4, output_len_median=4)   # warm-up
                runs[name].append(bench_endpoint(s.url, rates, num_requests=args.num_requests,
                                                 prompt_len_median=16, output_len_median=24))
    best = {}
    for name, rs in runs.items():
        rs.sort(key=lambda r: r["rates"][-1]["throughput_tokens_per_s"])
        best[name] = rs[len(rs) // 2]
    base = best["1 engine"]["rates"]
    print(f"{'set-up':>11} {'rate/s':>7} {'tok/s':>7} {'vs 1':>5} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9}")
    for name, res in best.items():
        for r, b in zip(res["rates"], base):
            ratio = r["throughput_tokens_per_s"] / b["throughput_tokens_per_s"]
            print(f"{name:>11} {r['request_rate']:>7g} {r['throughput_tokens_per_s']:>7.0f} {ratio:>5.2f} "
                  f"{r['ttft_s']['p50'] * 1e3:>7.0f}ms {r['ttft_s']['p99'] * 1e3:>7.0f}ms "
                  f"{r['tpot_s']['p50'] * 1e3:>7.1f}ms {r['tpot_s']['p99'] * 1e3:>7.1f}ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "reported": best}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
