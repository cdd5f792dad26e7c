"""The serving planner's decode step times against llmlab's engine on this machine (issue 41).

Calibrates (memory bandwidth, matmul FLOP/s, the engine's per-step and per-sequence costs), then
measures decode steps at six (batch, context) points and prints predicted against measured, the
relative errors and the Spearman rank correlation (the same as ``llmlab plan --serve --calibrate``).
Run: ``python benchmarks/bench_plan_serve.py [--json out.json]``.
"""
from __future__ import annotations

import argparse
import json

from llmlab.planner.serve_validate import calibrate_serving, format_serve_validation, validate_serving


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    here = calibrate_serving()
    v = validate_serving(here)
    print(f"memory bandwidth {here['hbm_bandwidth'] / 1e9:.1f} GB/s, {here['flop_rate'] / 1e9:.1f} GFLOP/s")
    print(format_serve_validation(v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(v, f, indent=1)


if __name__ == "__main__":
    main()
