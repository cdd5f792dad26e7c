"""ZeRO-3 step time against PyTorch FSDP2 (``fully_shard``), same model, data and ranks, one run.

    PYTHONPATH=$PWD python benchmarks/zero3_vs_fsdp2.py [--model tiny] [--dp 2] [--steps 10]

Both are trained side by side on the same ranks, alternating steps (ours, FSDP2, ours, ...), so
a busy machine slows both alike. Each is wrapped per decoder layer (FSDP2: ``fully_shard`` on
every layer and on the root; ours: every layer, the embedding, norm and LM head). Prints the
median step time of each and the ratio ours / FSDP2 (target <= 1.3 on CPU/gloo).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import llmlab


def bench_rank(model: str, dp: int, steps: int, warmup: int, seq_len: int, gbs: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from llmlab.data import BatchLoader
    from llmlab.runtime.mesh import Mesh
    from llmlab.training.config import TrainConfig, model_config
    from llmlab.training.trainer import Engine, make_optimizer

    cfg = TrainConfig(model=model, dp=dp, zero=3, steps=steps, seq_len=seq_len, global_batch_size=gbs)
    mesh = Mesh.build(dp=dp)
    ours = Engine(cfg, mesh, torch.device("cpu"))
    ref = llmlab.LlamaForCausalLM(model_config(cfg), seed=cfg.seed)
    dmesh = init_device_mesh("cpu", (dp,))
    for layer in ref.model.layers:
        fully_shard(layer, mesh=dmesh)
    fully_shard(ref, mesh=dmesh)
    ref_opt = make_optimizer(ref.parameters(), cfg)
    loader = BatchLoader(global_batch_size=gbs, seq_len=seq_len, seed=cfg.seed)

    def zero3_step(micro):    # the bare step: no trainer bookkeeping (activation hooks)
        for x, y in micro:
            ours.wrapper(x, y).backward()
        ours.wrapper.finish_grad_sync()
        ours.optimizer.step()
        ours.optimizer.zero_grad()

    def fsdp2_step(micro):
        for x, y in micro:
            ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    times = {"zero3": [], "fsdp2": []}
    for step in range(1, warmup + steps + 1):
        micro = loader.microbatches(step, mesh.coords["dp"], dp, 1)
        for name, fn in (("zero3", zero3_step), ("fsdp2", fsdp2_step)):
            dist.barrier()
            t0 = time.perf_counter()
            fn(micro)
            dist.barrier()
            if step > warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    res = llmlab.launch(bench_rank, a.dp, a.model, a.dp, a.steps, a.warmup, a.seq_len,
                        a.global_batch_size, backend="gloo")
    t = res[0]
    ours, theirs = statistics.median(t["zero3"]), statistics.median(t["fsdp2"])
    out = {"model": a.model, "dp": a.dp, "steps": a.steps, "zero3_step_s": ours,
           "fsdp2_step_s": theirs, "ratio_zero3_over_fsdp2": ours / theirs, "target": 1.3}
    print(f"{a.model} dp={a.dp}: ZeRO-3 {ours * 1e3:.1f} ms/step, FSDP2 {theirs * 1e3:.1f} ms/step, "
          f"ratio {ours / theirs:.2f}x (target <= 1.3x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
