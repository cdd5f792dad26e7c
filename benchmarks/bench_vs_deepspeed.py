"""llmlab's ZeRO 1/2/3 beside DeepSpeed's on the same model, ranks and data, in one run (issue 28).

    python benchmarks/bench_vs_deepspeed.py                     # stages 1 2 3, then with offload
    python benchmarks/bench_vs_deepspeed.py --stages 3 --steps 6 --no-offload

First run: makes (or reuses) `.venv-peers/` with DeepSpeed 0.19.8 (benchmarks/peer_env.py; the
same environment as vLLM's, whose torch 2.13.0+cpu DeepSpeed builds against). The ranks run
there under `torchrun` with `DS_ACCELERATOR=cpu` and gloo; llmlab is imported from this checkout.

Each rank builds both systems from the same initial weights (llmlab's `small` preset, seed 0),
the same AdamW (lr 3e-3, betas 0.9/0.95, eps 1e-8, no weight decay; DeepSpeed wraps the same
torch optimizer), fp32, dp 2, the same micro-batches; the steps alternate between the systems
(llmlab, DeepSpeed, llmlab, ...) so the load of a shared machine hits both alike. Printed per
stage: the median step time of each after warm-up and the ratio (target <= 1.0x), the model-state
bytes each rank holds (the distinct tensor storages reachable from each system's engine: weights,
gradients, fp32 masters, Adam moments, flat buffers), and the loss and global gradient norm of
both at the first steps (same maths: equal at step 1 to fp32 rounding). `--offload` runs: ZeRO
with the optimizer states in CPU memory (llmlab `cpu_offload`; DeepSpeed `offload_optimizer`
with the torch optimizer, not its C++ CPU Adam) — on a CPU-only machine this is the same memory,
so it measures the bookkeeping.
Numbers are printed as measured; a missed target says MISSED rather than failing the script.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_env  # noqa: E402


def reachable_bytes(root) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through Python objects
    (not through modules, classes or functions, so globals of other systems are not counted)."""
    import types

    import torch
    seen_obj, seen_st, total, todo = set(), set(), 0, [root]
    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)
    while todo:
        o = todo.pop()
        if id(o) in seen_obj or isinstance(o, skip):
            continue
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.layout == torch.strided and not o.is_meta:
                s = o.untyped_storage()
                if s.data_ptr() not in seen_st and s.nbytes():
                    seen_st.add(s.data_ptr())
                    total += s.nbytes()
            if o.grad is not None:
                todo.append(o.grad)
            todo.extend(v for v in getattr(o, "__dict__", {}).values())
            continue
        todo.extend(gc.get_referents(o))
    return total


def ds_config(stage: int, micro: int, offload: bool) -> dict:
    zero = {"stage": stage}                   # DeepSpeed's own defaults for everything else
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    # DeepSpeed 0.19 clips the global gradient norm to 1.0 unless told otherwise
    # (GRADIENT_CLIPPING_DEFAULT); llmlab's step here does not clip, so neither may DeepSpeed's:
    # with the default the first update was scaled by 1/20 and the runs parted from step 2 on.
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False, "wall_clock_breakdown": False,
            "steps_per_print": 10**9}


def rank_main(a) -> None:
    """One rank under torchrun: both systems, alternating steps; rank 0 writes the result."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    import deepspeed
    from llmlab.data import BatchLoader
    from llmlab.model.llama import LlamaForCausalLM
    from llmlab.runtime.mesh import Mesh
    from llmlab.training.config import TrainConfig, model_config
    from llmlab.training.grad_norm import global_grad_norm, owns
    from llmlab.training.trainer import Engine, global_loss, make_optimizer

    torch.set_num_threads(max(1, os.cpu_count() // dist.get_world_size()))
    dp = dist.get_world_size()
    cfg = TrainConfig(model=a.model, dp=dp, zero=a.stage, steps=a.steps, seq_len=a.seq_len,
                      global_batch_size=a.global_batch_size, cpu_offload=a.offload)
    ours = Engine(cfg, Mesh.build(dp=dp), torch.device("cpu"))
    ref = LlamaForCausalLM(model_config(cfg), seed=cfg.seed)
    theirs, *_ = deepspeed.initialize(model=ref, optimizer=make_optimizer(ref.parameters(), cfg),
                                      config=ds_config(a.stage, a.global_batch_size // dp, a.offload))
    loader = BatchLoader(global_batch_size=a.global_batch_size, seq_len=a.seq_len, seed=cfg.seed)
    rank = dist.get_rank()

    def ds_step(micro):
        (x, y), = micro
        loss = theirs(x, y)
        theirs.backward(loss)
        theirs.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / dp, float(theirs.get_global_grad_norm())

    def our_step(micro, step):
        """Engine.train_step without the trainer's bookkeeping (activation-memory hooks, byte
        counters, loss scaling, schedule): forward/backward, gradient sync, the global gradient
        norm (DeepSpeed computes it every step too), the optimizer step."""
        (x, y), = micro
        loss = ours.wrapper(x, y)
        loss.backward()
        ours.wrapper.finish_grad_sync()
        if hasattr(ours.optimizer, "unscale"):
            ours.optimizer.unscale()                  # masters' .grad -> the reduced shards
        pieces = ours.grad_pieces()
        norm, _ = global_grad_norm([(g, owns(p, ours.mesh, True)) for g, p in pieces], ours.device)
        ours.optimizer.apply() if hasattr(ours.optimizer, "apply") else ours.optimizer.step()
        ours.optimizer.zero_grad(set_to_none=True)
        return global_loss(loss.item(), ours.mesh, ours.device), float(norm)

    times, first = {"llmlab": [], "deepspeed": []}, []
    for step in range(1, a.warmup + a.steps + 1):
        micro = loader.microbatches(step, rank, dp, 1)
        row = {}
        for name in (("llmlab", "deepspeed") if step % 2 else ("deepspeed", "llmlab")):
            dist.barrier()
            t0 = time.perf_counter()
            row[name] = our_step(micro, step) if name == "llmlab" else ds_step(micro)
            dist.barrier()
            if step > a.warmup:
                times[name].append(time.perf_counter() - t0)
        if step <= 3:
            first.append({"step": step, **row})
    mem = {"llmlab": reachable_bytes(ours), "deepspeed": reachable_bytes(theirs)}
    mems = [None] * dp
    dist.all_gather_object(mems, mem)
    if rank == 0:
        Path(a.out).write_text(json.dumps({"times": times, "first": first, "mem": mems}))
    dist.destroy_process_group()


def run_stage(py: Path, stage: int, offload: bool, a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        env = dict(os.environ, PYTHONPATH=str(peer_env.REPO), DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // a.dp)))
        cmd = [str(py), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.dp}",
               __file__, "--rank", "--stage", str(stage), "--out", str(out),
               "--model", a.model, "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--seq-len", str(a.seq_len), "--global-batch-size", str(a.global_batch_size)]
        if offload:
            cmd.append("--offload")
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"stage {stage} failed (rc {r.returncode}):\n{r.stderr[-5000:]}")
        return json.loads(out.read_text())


def report(stage: int, offload: bool, res: dict) -> bool:
    t = {k: statistics.median(v) for k, v in res["times"].items()}
    ratio = t["llmlab"] / t["deepspeed"]
    tag = f"ZeRO-{stage}{' + offload' if offload else ''}"
    ok = ratio <= 1.0
    print(f"  {tag:16s} llmlab {t['llmlab'] * 1e3:7.1f} ms/step   DeepSpeed {t['deepspeed'] * 1e3:7.1f} "
          f"ms/step   ratio {ratio:.2f}x (target <= 1.0x) {'met' if ok else 'MISSED'}")
    for r, m in enumerate(res["mem"]):
        print(f"  {'':16s} rank {r} model-state bytes: llmlab {m['llmlab'] / 2**20:7.1f} MiB   "
              f"DeepSpeed {m['deepspeed'] / 2**20:7.1f} MiB")
    for f in res["first"]:
        (la, ga), (lb, gb) = f["llmlab"], f["deepspeed"]
        print(f"  {'':16s} step {f['step']}: loss {la:.7f} vs {lb:.7f} (|d| {abs(la - lb):.1e})   "
              f"grad norm {ga:.7f} vs {gb:.7f} (rel {abs(ga - gb) / max(abs(gb), 1e-30):.1e})")
    f = res["first"][0]
    same = (abs(f["llmlab"][0] - f["deepspeed"][0]) <= 1e-5 * abs(f["deepspeed"][0])
            and abs(f["llmlab"][1] - f["deepspeed"][1]) <= 1e-4 * abs(f["deepspeed"][1]))
    print(f"  {'':16s} step 1 equal to fp32 rounding: {'yes' if same else 'NO'}", flush=True)
    return ok and same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--no-offload", action="store_true", help="skip the CPU-offload runs")
    p.add_argument("--model", default="small")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--torch-wheel", default=None)
    a = p.parse_args(argv)
    if a.rank:
        rank_main(a)
        return 0
    py = peer_env.ensure_venv(("deepspeed",), a.torch_wheel)
    la = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"llmlab ZeRO vs DeepSpeed {peer_env.DEEPSPEED.split('==')[1]}: model {a.model}, dp {a.dp} "
          f"(gloo, DS_ACCELERATOR=cpu), seq_len {a.seq_len}, global batch {a.global_batch_size}, "
          f"fp32, {a.steps} timed steps after {a.warmup}, alternating; {os.cpu_count()} CPUs, "
          f"load average {la}", flush=True)
    ok = True
    for offload in ([False] if a.no_offload else [False, True]):
        for s in (int(x) for x in a.stages.split(",")):
            ok &= report(s, offload, run_stage(py, s, offload, a))
    print("all targets met" if ok else "some targets MISSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
