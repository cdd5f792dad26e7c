"""Expert parallelism measured: imbalance vs balancing loss, drops vs capacity, all-to-all bytes.

    PYTHONPATH=$PWD python benchmarks/moe_ep.py [--dp 2] [--ep 2] [--steps 20] [--json OUT]

Trains ``tiny-moe`` on ``dp`` real gloo ranks with ``ep``-way expert parallelism
(:func:`llmlab.tools.ep_probe.ep_probe`) and prints, in one run:

* tokens per expert per step: imbalance (max/mean, mean over layers) for balancing-loss
  coefficients 0, 0.01 and 0.1, top-1 routing (Switch Transformer §2.2);
* dropped-assignment fraction and tokens/s for capacity factors 0.5 .. 2 and dropless;
* all-to-all payload bytes per rank per MoE layer, measured, beside ``4·k·N·h·4 + E·8``.
"""
from __future__ import annotations

import argparse
import json

import llmlab
from llmlab.model.config import get_preset
from llmlab.tools.ep_probe import ep_probe
from llmlab.parallel.expert_parallel import a2a_bytes_formula


def _runs(dp, ep, steps, settings):
    return [ep_probe(dp=dp, ep=ep, steps=steps, **s) for s in settings]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    coefs = [0.0, 0.01, 0.1]
    cfs = [0.5, 1.0, 1.5, 2.0, None]
    settings = [{"router_aux_loss_coef": c, "num_experts_per_tok": 1} for c in coefs] + [{"capacity_factor": cf} for cf in cfs]
    runs = llmlab.launch(_runs, a.dp, a.dp, a.ep, a.steps, settings, backend="gloo")[0]
    out = {"dp": a.dp, "ep": a.ep, "steps": a.steps, "balance": [], "capacity": []}
    print(f"tiny-moe, dp={a.dp} ep={a.ep}, {a.steps} steps, global batch 8 x 32 tokens")
    print("\ntop-1: balancing-loss coef   mean imbalance   last-10-steps imbalance   final loss")
    for c, run in zip(coefs, runs[:3]):
        m = sum(r["imbalance"] for r in run) / len(run)
        last = sum(r["imbalance"] for r in run[-10:]) / len(run[-10:])
        print(f"{c:>26}   {m:14.3f}   {last:23.3f}   {run[-1]['loss']:.4f}")
        out["balance"].append({"coef": c, "mean_imbalance": m, "last10_imbalance": last,
                               "tokens_per_expert_final": run[-1]["tokens_per_expert"]})
    print("\ncapacity factor   dropped   tokens/s   a2a bytes/rank/layer")
    for cf, run in zip(cfs, runs[3:]):
        d = sum(r["dropped_fraction"] for r in run) / len(run)
        t = sum(r["tokens_per_s"] for r in run[1:]) / max(1, len(run) - 1)
        b = sum(r["a2a_bytes_per_layer"] for r in run) / len(run)
        print(f"{str(cf) if cf else 'dropless':>15}   {d:7.1%}   {t:8.0f}   {b:12,.0f}")
        out["capacity"].append({"capacity_factor": cf, "dropped_fraction": d, "tokens_per_s": t,
                                "a2a_bytes_per_layer": b})
    mc = get_preset("tiny-moe")
    N = 8 // a.dp * 32
    formula = 4 * a2a_bytes_formula(N, mc.hidden_size, mc.num_experts_per_tok) + mc.num_experts * 8
    measured = out["capacity"][-1]["a2a_bytes_per_layer"]
    print(f"\nall-to-all per rank per layer (dropless): measured {measured:,.0f} B, "
          f"formula 4*k*N*h*4 + E*8 = {formula:,} B, ratio {measured / formula:.4f}")
    out["a2a"] = {"measured": measured, "formula": formula}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
