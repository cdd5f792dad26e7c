"""llmlab DDP step time against PyTorch DistributedDataParallel, side by side in one run.

Each rank builds the same model twice (same seed), wraps one copy with
``llmlab.parallel.data_parallel`` (mode ``ddp``, or ``--mode naive|ring``) and the other with
``torch.nn.parallel.DistributedDataParallel``, with the same buckets (PyTorch's sizes: a 1 MiB
first bucket, then ``--bucket-mb``), and times full training steps (forward, backward with
gradient all-reduce, AdamW step) alternating between the two in rounds, so machine load affects
both alike.

The headline ratio llmlab / PyTorch (target: <= 1.05 for ddp) is the median over rounds of the
ratio within each round: the two systems run back to back, so a change of load between rounds
cancels. Also printed: the ratio of the median step times, of the minima, and of the median CPU
time per step (process time, all threads, the slowest rank). On a shared machine the wall-clock
times move with the other processes' load; CPU time measures the work each implementation does.
On CUDA with at least ``--world-size`` GPUs it uses NCCL, one GPU per rank.

    python benchmarks/bench_ddp.py                       # 2 ranks, model "small", gloo
    python benchmarks/bench_ddp.py --world-size 4 --model base --batch 8 --seq-len 256 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llmlab  # noqa: E402


def _rank(model_name, batch, seq_len, bucket_mb, mode, rounds, steps_per_round, warmup):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from llmlab.data import BatchLoader
    from llmlab.parallel.data_parallel import wrap_data_parallel
    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = dist.get_world_size()
    mesh = llmlab.Mesh.build(dp=n)
    cfg = llmlab.get_preset(model_name, max_position_embeddings=max(seq_len, 256))
    a = llmlab.LlamaForCausalLM(cfg, seed=0).to(dev)
    b = llmlab.LlamaForCausalLM(cfg, seed=0).to(dev)
    ours = wrap_data_parallel(a, mesh, mode=mode, bucket_mb=bucket_mb)
    theirs = TorchDDP(b, bucket_cap_mb=bucket_mb, device_ids=[dev.index] if cuda else None)
    opts = {"llmlab": torch.optim.AdamW(a.parameters(), lr=1e-3),
            "torch": torch.optim.AdamW(b.parameters(), lr=1e-3)}
    loader = BatchLoader(global_batch_size=batch * n, seq_len=seq_len, seed=0)

    def step(name, model, i):
        x, y = (t.to(dev) for t in loader.local_batch(i, mesh.coords["dp"], n))
        model(x, y).backward()
        if name == "llmlab":
            model.finish_grad_sync()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    times = {"llmlab": [], "torch": []}
    cpu = {"llmlab": [], "torch": []}
    systems = [("llmlab", ours), ("torch", theirs)]
    for r in range(rounds + warmup):
        for name, model in (systems if r % 2 == 0 else systems[::-1]):
            dist.barrier()
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(steps_per_round):
                step(name, model, r * steps_per_round + i + 1)
            sync()
            t = torch.tensor([(time.perf_counter() - t0) / steps_per_round,
                              (time.process_time() - c0) / steps_per_round], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r >= warmup:
                times[name].append(t[0].item())
                cpu[name].append(t[1].item())
    paired = [a / b for a, b in zip(times["llmlab"], times["torch"])]  # same round, back to back
    return {"paired_ratio": statistics.median(paired)} | {
        k: statistics.median(v) for k, v in times.items()} | {
        f"{k}_min": min(v) for k, v in times.items()} | {
        f"{k}_cpu": statistics.median(v) for k, v in cpu.items()} | {
        "num_params": sum(p.numel() for p in a.parameters()),
        "num_buckets": len(getattr(ours, "buckets", [])),
        "device": str(dev.type)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--mode", default="ddp", choices=["ddp", "naive", "ring"])
    p.add_argument("--rounds", type=int, default=20, help="alternating rounds (medians over them)")
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = llmlab.launch(_rank, args.world_size, args.model, args.batch, args.seq_len,
                        args.bucket_mb, args.mode, args.rounds, args.steps_per_round, args.warmup,
                        backend=args.backend)[0]
    ratio = res["paired_ratio"]
    out = {"model": args.model, "world_size": args.world_size, "device": res["device"],
           "mode": args.mode, "bucket_mb": args.bucket_mb, "num_params": res["num_params"],
           "num_buckets": res["num_buckets"], "batch_per_rank": args.batch, "seq_len": args.seq_len,
           "llmlab_step_s": res["llmlab"], "torch_ddp_step_s": res["torch"], "ratio": ratio,
           "ratio_of_medians": res["llmlab"] / res["torch"],
           "llmlab_step_min_s": res["llmlab_min"], "torch_ddp_step_min_s": res["torch_min"],
           "ratio_of_min": res["llmlab_min"] / res["torch_min"],
           "llmlab_cpu_s": res["llmlab_cpu"], "torch_ddp_cpu_s": res["torch_cpu"],
           "ratio_cpu": res["llmlab_cpu"] / res["torch_cpu"], "rounds": args.rounds}
    print(f"model {args.model} ({res['num_params'] / 1e6:.1f} M params), {args.world_size} ranks on "
          f"{res['device']}, llmlab {args.mode} ({res['num_buckets']} buckets of <= {args.bucket_mb} MB)")
    print(f"  llmlab    {res['llmlab'] * 1e3:8.1f} ms/step median  {res['llmlab_min'] * 1e3:8.1f} min")
    print(f"  torch DDP {res['torch'] * 1e3:8.1f} ms/step median  {res['torch_min'] * 1e3:8.1f} min")
    print(f"  CPU time  llmlab {res['llmlab_cpu'] * 1e3:.1f} ms/step, torch DDP "
          f"{res['torch_cpu'] * 1e3:.1f} ms/step (medians)")
    print(f"  ratio llmlab / torch = {ratio:.3f} (median over {args.rounds} alternating rounds of the "
          f"ratio within a round)  (target <= 1.05)")
    print(f"    other views: {out['ratio_of_medians']:.3f} (ratio of medians), {out['ratio_of_min']:.3f} "
          f"(minima), {out['ratio_cpu']:.3f} (CPU time)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
