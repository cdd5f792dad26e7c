"""Self-test checks of training (one device; every parallel layout on 2 real ranks) and
measurements of the machine (collectives' bus bandwidth, MFU) (see :mod:`llmlab.selftest`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from llmlab.runtime.process import child_threads
from llmlab.selftest.common import FAIL, PASS, _gpu


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def check_train_one_device(quick: bool) -> dict:
    from llmlab.training.config import TrainConfig
    from llmlab.training.trainer import rank_main

    steps = 5 if quick else 20
    kw: dict[str, Any]
    if _gpu():
        kw = dict(model="small", global_batch_size=8, seq_len=256, device="cuda")
    else:
        torch.set_num_threads(min(2, child_threads(1, "gloo")))  # the seat's cores, 2 at most
        kw = dict(model="tiny", global_batch_size=4, seq_len=32, device="cpu")
    losses = {}
    for dtype in ("fp32", "bf16"):
        r = rank_main(TrainConfig(steps=steps, dtype=dtype, seed=0, **kw))
        losses[dtype] = [s["loss"] for s in r["steps"]]
    # gate: trailing 5-step means (one small batch's loss can jump; the curves must not part)
    w = min(5, steps)
    mean = {
        k: [sum(v[max(0, i - w + 1) : i + 1]) / len(v[max(0, i - w + 1) : i + 1]) for i in range(len(v))]
        for k, v in losses.items()
    }
    rel = max(abs(a - b) / abs(a) for a, b in zip(mean["fp32"], mean["bf16"]))
    step_rel = max(abs(a - b) / abs(a) for a, b in zip(losses["fp32"], losses["bf16"]))
    ok = rel <= 0.02 and all(math.isfinite(x) for x in losses["bf16"])
    out = {
        "status": PASS if ok else FAIL,
        "steps": steps,
        "model": kw["model"],
        "max_rel_diff": rel,
        "max_rel_diff_single_step": step_rel,
        "loss_fp32": losses["fp32"][-1],
        "loss_bf16": losses["bf16"][-1],
        "detail": f"{kw['model']}, {steps} steps: bf16 within {rel:.2%} of fp32 ({w}-step "
        f"means, limit 2%; worst single step {step_rel:.2%}), final loss "
        f"{losses['fp32'][-1]:.4f} / {losses['bf16'][-1]:.4f}",
    }
    if not ok:
        out["reason"] = f"bf16 differs from fp32 by {rel:.2%} > 2% ({w}-step means)"
    return out


def _layouts(quick: bool, gpu: bool) -> dict:
    # GPU: 8 x 1024 x 256 fp32 = 8 MiB per message, above NCCL's 4 MiB buffers
    big = dict(seq_len=1024, global_batch_size=16) if gpu else dict(seq_len=256, global_batch_size=4)
    lay = {
        "dp2": dict(dp=2),
        "tp2+sp": dict(tp=2, sequence_parallel=True),
        "pp2 gpipe": dict(pp=2, pp_schedule="gpipe", num_microbatches=2),
        "pp2 1f1b": dict(pp=2, pp_schedule="1f1b", num_microbatches=4),
        "pp2 interleaved": dict(pp=2, pp_schedule="interleaved", virtual_stages=2, num_microbatches=4),
        "ep2": dict(dp=2, ep=2, model="tiny-moe"),
        "zero1": dict(dp=2, zero=1),
        "zero2": dict(dp=2, zero=2),
        "zero3": dict(dp=2, zero=3),
        "pp2 interleaved, large activations": dict(
            pp=2, pp_schedule="interleaved", virtual_stages=2, num_microbatches=2, **big
        ),
    }
    if quick:
        for k in ("pp2 gpipe", "zero1", "zero2"):
            del lay[k]
    return lay


def _layout_rank(cfgs: dict) -> dict:
    from llmlab.training.trainer import rank_main

    return {name: [s["loss"] for s in (rank_main(c)["steps"] or [])] for name, c in cfgs.items()}


def check_train_layouts(quick: bool) -> dict:
    from llmlab.runtime.launch import launch
    from llmlab.training.config import TrainConfig, validate
    from llmlab.training.trainer import rank_main

    gpus = torch.cuda.device_count() if _gpu() else 0
    nccl = gpus >= 2
    device = "cuda" if nccl else "cpu"
    steps = 2 if quick else 3
    base = dict(
        model="small" if nccl else "tiny", steps=steps, global_batch_size=4, seq_len=16, seed=0, device=device
    )
    cfgs = {}
    for name, kw in _layouts(quick, nccl).items():
        cfgs[name] = TrainConfig(**(base | kw))
        validate(cfgs[name])
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res = launch(_layout_rank, 2, cfgs, backend="nccl" if nccl else "gloo", timeout=900)[0]
    t_par = time.perf_counter() - t0
    refs, worst, bad = {}, 0.0, []
    for name, c in cfgs.items():
        one = TrainConfig(
            **(
                vars(c)
                | dict(
                    dp=1,
                    tp=1,
                    pp=1,
                    ep=1,
                    zero=0,
                    pp_schedule="1f1b",
                    virtual_stages=1,
                    num_microbatches=1,
                    sequence_parallel=False,
                    device=device if nccl else "cpu",
                )
            )
        )
        key = (one.model, one.seq_len, one.global_batch_size)
        if key not in refs:
            refs[key] = [s["loss"] for s in rank_main(one)["steps"]]
        got, want = res[name], refs[key]
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want)) if len(got) == len(want) else 1.0
        worst = max(worst, rel)
        if rel > 1e-4:
            bad.append(f"{name}: losses {got} vs one device {want}")
    out = {
        "status": FAIL if bad else PASS,
        "backend": "nccl" if nccl else "gloo",
        "layouts": list(cfgs),
        "max_rel_loss_diff": worst,
        "parallel_seconds": t_par,
        "detail": f"{len(cfgs)} layouts on 2 {'NCCL' if nccl else 'gloo'} ranks, losses equal "
        f"one device within {worst:.1e} (limit 1e-4) over {steps} steps",
    }
    if bad:
        out["reason"] = "; ".join(bad)
    return out


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------
def _collective_rank(nbytes: int, iters: int) -> dict:
    import torch.distributed as dist

    from llmlab.runtime import comm

    n, r = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    numel = nbytes // 4 // n * n  # reduce-scatter needs a multiple of the rank count
    sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)
    res = {}
    x = torch.full((numel,), float(r + 1), device=dev)
    gathered = torch.empty(numel * n, device=dev)
    shard = torch.empty(numel // n, device=dev)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):

        def run():
            if op == "all_reduce":
                y = torch.full((numel,), float(r + 1), device=dev)
                dist.all_reduce(y)
                return y
            if op == "all_gather":
                comm.dist_all_gather_single(gathered, x)
                return gathered
            comm.dist_reduce_scatter_single(shard, x)
            return shard

        y = run()
        sync()
        if op == "all_gather":  # block i holds rank i's value i+1
            ranks = torch.arange(1, n + 1, device=dev, dtype=torch.float32)[:, None]
            ok = bool((y.view(n, numel) == ranks).all())
        else:
            ok = bool((y == n * (n + 1) / 2).all())
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        sync()
        dt = (time.perf_counter() - t0) / iters
        size = nbytes * (n if op == "all_gather" else 1)
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        res[op] = {"ok": ok, "time_s": dt, "busbw_GBps": size * factor / dt / 1e9}
    return res


def check_collectives(quick: bool) -> dict:
    from llmlab.runtime.launch import launch

    gpus = torch.cuda.device_count() if _gpu() else 0
    nccl = gpus >= 2
    n = min(gpus, 8) if nccl else 2
    nbytes = (256 << 20 if not quick else 64 << 20) if nccl else (4 << 20 if not quick else 1 << 20)
    res = launch(
        _collective_rank, n, nbytes, 5 if not quick else 2, backend="nccl" if nccl else "gloo", timeout=300
    )[0]
    bad = [op for op, v in res.items() if not v["ok"]]
    out = {
        "status": FAIL if bad else PASS,
        "backend": "nccl" if nccl else "gloo",
        "ranks": n,
        "bytes": nbytes,
        "results": res,
        "detail": f"{n} {'NCCL' if nccl else 'gloo'} ranks, {nbytes >> 20} MiB: "
        + ", ".join(f"{op} busbw {v['busbw_GBps']:.2f} GB/s" for op, v in res.items()),
    }
    if bad:
        out["reason"] = f"wrong results: {bad}"
    return out


def check_mfu(quick: bool) -> dict:
    from llmlab.metrics.throughput import peak_flops, training_flops_per_token
    from llmlab.model.config import get_preset
    from llmlab.training.config import TrainConfig
    from llmlab.training.trainer import rank_main

    if _gpu():
        cfg = TrainConfig(
            model="small",
            steps=4 if quick else 10,
            global_batch_size=16,
            seq_len=512,
            dtype="bf16",
            device="cuda",
        )
    else:
        torch.set_num_threads(min(2, child_threads(1, "gloo")))  # the seat's cores, 2 at most
        cfg = TrainConfig(
            model="tiny", steps=3 if quick else 6, global_batch_size=8, seq_len=64, device="cpu"
        )
    steps = rank_main(cfg)["steps"][1:]  # the first step pays one-time costs
    mc = get_preset(cfg.model)
    fpt = training_flops_per_token(mc.num_parameters(), mc.num_hidden_layers, mc.hidden_size, cfg.seq_len)
    tps = sorted(s["tokens_per_s"] for s in steps)[len(steps) // 2]
    achieved = tps * fpt
    peak = peak_flops("cuda", cfg.dtype) if _gpu() else None
    name = torch.cuda.get_device_name() if _gpu() else "CPU"
    out = {
        "status": PASS if achieved > 0 else FAIL,
        "model": cfg.model,
        "dtype": cfg.dtype,
        "tokens_per_s": tps,
        "achieved_flops": achieved,
        "peak_flops": peak,
        "mfu": achieved / peak if peak else None,
    }
    out["detail"] = f"{cfg.model} {cfg.dtype}: {achieved / 1e12:.3f} TFLOP/s achieved" + (
        f", peak {peak / 1e12:.0f} TFLOP/s ({name} {cfg.dtype}): MFU {achieved / peak:.1%}"
        if peak
        else f"; no peak figure for {name} {cfg.dtype}, MFU not computed"
    )
    return out
