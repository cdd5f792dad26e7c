"""``llmlab doctor --selftest [--quick] [--json PATH]``: prove on this machine, in one command, that
the kernels, the engine, training on one device and every parallel layout compute what their
references compute, and measure what the machine does.

Each check runs in its own Python process with its own timeout (a hang is a FAIL, the process
group is killed, nothing is left running) and prints one line: ``PASS``, ``FAIL`` (with the error)
or ``SKIP`` (with the reason: a check the hardware cannot run), with its measured numbers.
``--json`` writes ``{"checks": {name: {"status", "seconds", ...}}, "hardware": {...}}``; the exit
code is 1 if any check fails. ``--quick`` runs every check on smaller sizes (<= 2 minutes on a
2-core CPU; the test suite runs it).

Checks (:data:`CHECKS`, in order):

* ``flash_attention_fwd``, ``flash_attention_bwd``, ``fused_rmsnorm``, ``fused_swiglu``,
  ``paged_attention_decode``, ``paged_attention_prefill``: the Triton kernels (compiled on a GPU,
  Triton's interpreter on CPU) against their PyTorch references in fp32/fp16/bf16 (bf16 ``tl.dot``
  kernels only on a GPU: Triton 3.9's interpreter multiplies bf16 dot operands as raw bits);
* ``engine_greedy_vs_hf``: the paged-KV engine's greedy tokens equal Hugging Face ``generate``
  (fp64, a random Llama checkpoint); ``engine_device_vs_cpu`` (GPU): CUDA tokens equal CPU fp32
  tokens up to the first step whose top-2 logit margin is below the dtype's tolerance;
* ``train_one_device``: bf16 training within 2% of fp32 over 20 steps (trailing 5-step loss
  means; ``small`` on a GPU, ``tiny`` on CPU);
* ``train_layouts``: DP, TP, PP (GPipe, 1F1B, interleaved), EP and ZeRO 1-3 on 2 real ranks
  (NCCL with >= 2 GPUs, gloo otherwise) equal one device, plus one interleaved run whose
  activations exceed NCCL's buffers;
* ``collectives``: all-reduce / all-gather / reduce-scatter results checked, bus bandwidth;
* ``mfu``: achieved model FLOP/s of a training run over the peak of its dtype (figure shown);
* ``paged_attention_bandwidth``: bytes of K/V read per second by paged decode over the peak.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import sys
import tempfile
import time
from typing import Callable

import torch

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
BF16_INTERPRETER = ("bf16 skipped on CPU: Triton 3.9's interpreter multiplies bf16 tl.dot operands "
                    "as raw bits")


class Skip(Exception):
    """Raised by a check the machine cannot run; the message is the reason."""


def _gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _dev() -> str:
    return "cuda" if _gpu() else "cpu"


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _need_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        raise Skip("triton is not installed: pip install -e \".[kernels]\"") from None


def _dtypes(dot: bool) -> tuple[list, str | None]:
    if _gpu():
        return [torch.float32, torch.float16, torch.bfloat16], None
    if dot:
        return [torch.float32, torch.float16], BF16_INTERPRETER
    return [torch.float32, torch.float16, torch.bfloat16], None


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs error relative to the reference's max magnitude (1 floor)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def _verdict(errs: dict, note: str | None = None, **extra) -> dict:
    bad = {k: v for k, v in errs.items() if not v["ok"]}
    out = {"status": FAIL if bad else PASS, "errors": errs, **extra}
    out["detail"] = ", ".join(f"{k} err {v['err']:.1e}" for k, v in errs.items())
    if bad:
        out["reason"] = "above tolerance: " + ", ".join(
            f"{k} {v['err']:.2e} > {v['tol']:.0e}" for k, v in bad.items())
    if note:
        out["note"] = note
    return out


def _attn_inputs(dtype, quick, grad):
    if _gpu():
        B, H, Hk, T, D = (1, 4, 2, 256, 64) if quick else (2, 8, 2, 1024, 64)
    else:
        B, H, Hk, T, D = (1, 2, 1, 20, 16) if quick else (1, 2, 1, 37, 16)
    g = torch.Generator().manual_seed(T)
    return [torch.randn(B, h, T, D, generator=g).to(_dev(), dtype).requires_grad_(grad)
            for h in (H, Hk, Hk)]


def check_flash_attention_fwd(quick: bool) -> dict:
    _need_triton()
    from llmlab.kernels.flash_attention import flash_attention
    from llmlab.kernels.reference import attention_reference
    dtypes, note = _dtypes(dot=True)
    errs = {}
    for dtype in dtypes:
        for causal in (True, False):
            q, k, v = _attn_inputs(dtype, quick, grad=False)
            out = flash_attention(q, k, v, causal, block_m=16 if not _gpu() else 64,
                                  block_n=16 if not _gpu() else 64)
            ref = attention_reference(q.float(), k.float(), v.float(), causal)
            e = _err(out, ref)
            errs[f"{_name(dtype)}{'' if causal else ' non-causal'}"] = {
                "err": e, "tol": TOL[dtype], "ok": e <= TOL[dtype] and out.dtype == dtype}
    return _verdict(errs, note, shape=list(q.shape))


def check_flash_attention_bwd(quick: bool) -> dict:
    _need_triton()
    from llmlab.kernels.flash_attention import flash_attention
    from llmlab.kernels.reference import attention_reference
    dtypes, note = _dtypes(dot=True)
    errs = {}
    for dtype in dtypes:
        q, k, v = _attn_inputs(dtype, quick, grad=True)
        bm = 64 if _gpu() else 16
        out = flash_attention(q, k, v, True, block_m=bm, block_n=bm)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(_dev(), dtype)
        got = torch.autograd.grad(out, (q, k, v), dout)
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(attention_reference(q32, k32, v32, True), (q32, k32, v32),
                                   dout.float())
        tol = TOL[dtype] * (2 if dtype != torch.float32 else 1)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            e = _err(a, b)
            errs[f"{_name(dtype)} {name}"] = {"err": e, "tol": tol, "ok": e <= tol}
    return _verdict(errs, note, shape=list(q.shape))


def _name(dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def _rows_cols(quick):
    if _gpu():
        return (512, 1024) if quick else (4096, 4096)
    return (9, 48) if quick else (37, 96)


def check_fused_rmsnorm(quick: bool) -> dict:
    _need_triton()
    from llmlab.kernels.fused_rmsnorm import rms_norm
    from llmlab.kernels.reference import rms_norm_reference
    dtypes, note = _dtypes(dot=False)
    errs = {}
    n, d = _rows_cols(quick)
    for dtype in dtypes:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(n, d, generator=g).to(_dev(), dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(d, generator=g)).to(_dev(), dtype).requires_grad_()
        out = rms_norm(x, w)
        dy = torch.randn(out.shape, generator=g).to(_dev(), dtype)
        got = (out,) + torch.autograd.grad(out, (x, w), dy)
        x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
        ref = rms_norm_reference(x32, w32)
        want = (ref,) + torch.autograd.grad(ref, (x32, w32), dy.float())
        for name, a, b in zip(("out", "dx", "dw"), got, want):
            tol = TOL[dtype] * (4 if name == "dw" and dtype != torch.float32 else 1)
            e = _err(a, b)
            errs[f"{_name(dtype)} {name}"] = {"err": e, "tol": tol, "ok": e <= tol}
    return _verdict(errs, note, shape=[n, d])


def check_fused_swiglu(quick: bool) -> dict:
    _need_triton()
    from llmlab.kernels.fused_swiglu import swiglu
    from llmlab.kernels.reference import swiglu_reference
    dtypes, note = _dtypes(dot=False)
    errs = {}
    n, d = _rows_cols(quick)
    for dtype in dtypes:
        g = torch.Generator().manual_seed(4)
        a_, b_ = (torch.randn(n, d, generator=g).to(_dev(), dtype).requires_grad_() for _ in range(2))
        out = swiglu(a_, b_)
        dy = torch.randn(out.shape, generator=g).to(_dev(), dtype)
        got = (out,) + torch.autograd.grad(out, (a_, b_), dy)
        a32, b32 = (t.detach().float().requires_grad_() for t in (a_, b_))
        ref = swiglu_reference(a32, b32)
        want = (ref,) + torch.autograd.grad(ref, (a32, b32), dy.float())
        for name, x, y in zip(("out", "dgate", "dup"), got, want):
            e = _err(x, y)
            errs[f"{_name(dtype)} {name}"] = {"err": e, "tol": TOL[dtype], "ok": e <= TOL[dtype]}
    return _verdict(errs, note, shape=[n, d])


def paged_case(block_size, H, Hkv, D, ctx_lens, query_lens, dtype, seed=0, device=None):
    """Random K/V written through shuffled block tables, and the step's queries: the arguments
    of :func:`~llmlab.inference.paged_attention.paged_attention_reference`."""
    import random

    from llmlab.inference.paged_attention import slot_mapping, write_kv
    dev = device or _dev()
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    nblk = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(nblk) + 2
    k_cache = torch.zeros(num_blocks, block_size, Hkv, D, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for ctx, nb in zip(ctx_lens, nblk):
        table = [free.pop() for _ in range(nb)]
        k = torch.randn(ctx, Hkv, D, generator=g).to(dev, dtype)
        v = torch.randn(ctx, Hkv, D, generator=g).to(dev, dtype)
        write_kv(k_cache, v_cache, k, v,
                 torch.tensor(slot_mapping(table, range(ctx), block_size), device=dev))
        tables.append(table + [0] * (max(nblk) - nb))
    q = torch.randn(sum(query_lens), H, D, generator=g).to(dev, dtype)
    return [q, k_cache, v_cache, torch.tensor(tables, device=dev),
            torch.tensor(ctx_lens, device=dev), torch.tensor(query_lens, device=dev)]


def _check_paged(quick: bool, prefill: bool) -> dict:
    _need_triton()
    from llmlab.inference.paged_attention import paged_attention_reference
    from llmlab.kernels.paged_attention import paged_attention_triton
    dtypes, note = _dtypes(dot=True)
    if _gpu():
        bs, H, Hkv, D = 16, 8, 2, 64
        ctx = [1, 15, 16, 17, 300] if quick else [1, 15, 16, 17, 300, 1000, 2049]
    else:
        bs, H, Hkv, D = 8, 4, 2, 16
        ctx = [1, 7, 9] if quick else [1, 7, 8, 9, 29]
    qlens = [min(c, 5 + i) if prefill else 1 for i, c in enumerate(ctx)]
    if prefill:
        qlens[0] = ctx[0]  # a whole prompt
    errs = {}
    for dtype in dtypes:
        args = paged_case(bs, H, Hkv, D, ctx, qlens, dtype, seed=len(ctx))
        out = paged_attention_triton(*args)
        ref = paged_attention_reference(args[0].float(), args[1].float(), args[2].float(), *args[3:])
        e = _err(out, ref)
        errs[_name(dtype)] = {"err": e, "tol": TOL[dtype], "ok": e <= TOL[dtype]}
    return _verdict(errs, note, context_lens=ctx, query_lens=qlens)


def check_paged_attention_decode(quick: bool) -> dict:
    return _check_paged(quick, prefill=False)


def check_paged_attention_prefill(quick: bool) -> dict:
    return _check_paged(quick, prefill=True)


# --------------------------------------------------------------------------------------------
# Inference engine
# --------------------------------------------------------------------------------------------
def _random_llama(path: str, vocab: int = 128) -> str:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.3, eos_token_id=3, bos_token_id=1,
                                   pad_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _prompts(n: int, vocab: int = 128) -> list[list[int]]:
    import random
    rng = random.Random(0)
    lengths = [1, 2, 15, 16, 17, 31]
    return [[rng.randrange(4, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def check_engine_greedy_vs_hf(quick: bool) -> dict:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise Skip("transformers is not installed") from None
    from llmlab.inference import LLM, SamplingParams
    n, new = (6, 6) if quick else (24, 12)
    with tempfile.TemporaryDirectory() as d:
        path = _random_llama(d)
        prompts = _prompts(n)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        want = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                row = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new, pad_token_id=0)[0, len(p):].tolist()
                want.append(row[:row.index(3) + 1] if 3 in row else row)
        llm = LLM(path, device="cpu", dtype=torch.float64, block_size=4)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new))
        got = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for a, b in zip(got, want))
    out = {"status": PASS if same == n else FAIL, "requests": n, "equal": same,
           "detail": f"{same}/{n} requests token-equal to HF generate (fp64, block size 4)"}
    if same != n:
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        out["reason"] = f"request {i}: engine {got[i]} vs HF {want[i]}"
    return out


def check_engine_device_vs_cpu(quick: bool) -> dict:
    if not _gpu():
        raise Skip("no CUDA GPU")
    from llmlab.inference import LLM, SamplingParams
    from llmlab.inference.loader import resolve_model_path
    path = str(resolve_model_path("shakespeare"))
    prompts = [[i % 50 + 5] * (1 + i % 7) for i in range(8 if quick else 32)]
    new = 16 if quick else 32
    params = SamplingParams(temperature=0.0, max_tokens=new)
    cpu = [o.outputs[0].token_ids for o in LLM(path, device="cpu").generate(prompts, params)]
    model = _shakespeare_model(path)
    res, worst = {}, None
    for dtype, tol in ((torch.float32, 1e-3), (torch.float16, 2e-2), (torch.bfloat16, 8e-2)):
        gpu = [o.outputs[0].token_ids for o in
               LLM(path, device="cuda", dtype=dtype).generate(prompts, params)]
        checked = equal = 0
        for p, a, b in zip(prompts, cpu, gpu):
            margins = _top2_margins(model, p, a)
            k = next((i for i, m in enumerate(margins) if m <= tol), len(a))  # decided tokens
            checked += k
            if a[:k] != b[:k]:
                worst = worst or f"{_name(dtype)}: prompt {p}: cpu {a[:k]} vs cuda {b[:k]}"
            else:
                equal += k
        res[_name(dtype)] = {"decided_tokens": checked, "equal": equal}
    ok = all(v["decided_tokens"] == v["equal"] for v in res.values())
    out = {"status": PASS if ok else FAIL, "dtypes": res,
           "detail": ", ".join(f"{k} {v['equal']}/{v['decided_tokens']} decided tokens equal"
                               for k, v in res.items())}
    if not ok:
        out["reason"] = worst
    return out


def _shakespeare_model(path):
    from llmlab.inference import loader
    model, _, _ = loader.load(path)
    return model.float().eval()


def _top2_margins(model, prompt, tokens) -> list[float]:
    """CPU fp32 gap between the top two logits before each generated token."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1:].float()  # [new tokens, vocab]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def check_train_one_device(quick: bool) -> dict:
    from llmlab.training.config import TrainConfig
    from llmlab.training.trainer import rank_main
    steps = 5 if quick else 20
    if _gpu():
        kw = dict(model="small", global_batch_size=8, seq_len=256, device="cuda")
    else:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        kw = dict(model="tiny", global_batch_size=4, seq_len=32, device="cpu")
    losses = {}
    for dtype in ("fp32", "bf16"):
        r = rank_main(TrainConfig(steps=steps, dtype=dtype, seed=0, **kw))
        losses[dtype] = [s["loss"] for s in r["steps"]]
    # gate: trailing 5-step means (one small batch's loss can jump; the curves must not part)
    w = min(5, steps)
    mean = {k: [sum(v[max(0, i - w + 1):i + 1]) / len(v[max(0, i - w + 1):i + 1])
                for i in range(len(v))] for k, v in losses.items()}
    rel = max(abs(a - b) / abs(a) for a, b in zip(mean["fp32"], mean["bf16"]))
    step_rel = max(abs(a - b) / abs(a) for a, b in zip(losses["fp32"], losses["bf16"]))
    ok = rel <= 0.02 and all(math.isfinite(x) for x in losses["bf16"])
    out = {"status": PASS if ok else FAIL, "steps": steps, "model": kw["model"],
           "max_rel_diff": rel, "max_rel_diff_single_step": step_rel,
           "loss_fp32": losses["fp32"][-1], "loss_bf16": losses["bf16"][-1],
           "detail": f"{kw['model']}, {steps} steps: bf16 within {rel:.2%} of fp32 ({w}-step "
                     f"means, limit 2%; worst single step {step_rel:.2%}), final loss "
                     f"{losses['fp32'][-1]:.4f} / {losses['bf16'][-1]:.4f}"}
    if not ok:
        out["reason"] = f"bf16 differs from fp32 by {rel:.2%} > 2% ({w}-step means)"
    return out


def _layouts(quick: bool, gpu: bool) -> dict:
    # GPU: 8 x 1024 x 256 fp32 = 8 MiB per message, above NCCL's 4 MiB buffers
    big = dict(seq_len=1024, global_batch_size=16) if gpu else dict(seq_len=256, global_batch_size=4)
    lay = {
        "dp2": dict(dp=2), "tp2+sp": dict(tp=2, sequence_parallel=True),
        "pp2 gpipe": dict(pp=2, pp_schedule="gpipe", num_microbatches=2),
        "pp2 1f1b": dict(pp=2, pp_schedule="1f1b", num_microbatches=4),
        "pp2 interleaved": dict(pp=2, pp_schedule="interleaved", virtual_stages=2, num_microbatches=4),
        "ep2": dict(dp=2, ep=2, model="tiny-moe"),
        "zero1": dict(dp=2, zero=1), "zero2": dict(dp=2, zero=2), "zero3": dict(dp=2, zero=3),
        "pp2 interleaved, large activations": dict(pp=2, pp_schedule="interleaved",
                                                   virtual_stages=2, num_microbatches=2, **big),
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
    base = dict(model="small" if nccl else "tiny", steps=steps, global_batch_size=4, seq_len=16,
                seed=0, device=device)
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
        one = TrainConfig(**(vars(c) | dict(dp=1, tp=1, pp=1, ep=1, zero=0, pp_schedule="1f1b",
                                            virtual_stages=1, num_microbatches=1,
                                            sequence_parallel=False,
                                            device=device if nccl else "cpu")))
        key = (one.model, one.seq_len, one.global_batch_size)
        if key not in refs:
            refs[key] = [s["loss"] for s in rank_main(one)["steps"]]
        got, want = res[name], refs[key]
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want)) if len(got) == len(want) else 1.0
        worst = max(worst, rel)
        if rel > 1e-4:
            bad.append(f"{name}: losses {got} vs one device {want}")
    out = {"status": FAIL if bad else PASS, "backend": "nccl" if nccl else "gloo",
           "layouts": list(cfgs), "max_rel_loss_diff": worst, "parallel_seconds": t_par,
           "detail": f"{len(cfgs)} layouts on 2 {'NCCL' if nccl else 'gloo'} ranks, losses equal "
                     f"one device within {worst:.1e} (limit 1e-4) over {steps} steps"}
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
    res = launch(_collective_rank, n, nbytes, 5 if not quick else 2,
                 backend="nccl" if nccl else "gloo", timeout=300)[0]
    bad = [op for op, v in res.items() if not v["ok"]]
    out = {"status": FAIL if bad else PASS, "backend": "nccl" if nccl else "gloo", "ranks": n,
           "bytes": nbytes, "results": res,
           "detail": f"{n} {'NCCL' if nccl else 'gloo'} ranks, {nbytes >> 20} MiB: " + ", ".join(
               f"{op} busbw {v['busbw_GBps']:.2f} GB/s" for op, v in res.items())}
    if bad:
        out["reason"] = f"wrong results: {bad}"
    return out


def check_mfu(quick: bool) -> dict:
    from llmlab.metrics.throughput import peak_flops, training_flops_per_token
    from llmlab.model.config import get_preset
    from llmlab.training.config import TrainConfig
    from llmlab.training.trainer import rank_main
    if _gpu():
        cfg = TrainConfig(model="small", steps=4 if quick else 10, global_batch_size=16,
                          seq_len=512, dtype="bf16", device="cuda")
    else:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        cfg = TrainConfig(model="tiny", steps=3 if quick else 6, global_batch_size=8,
                          seq_len=64, device="cpu")
    steps = rank_main(cfg)["steps"][1:]  # the first step pays one-time costs
    mc = get_preset(cfg.model)
    fpt = training_flops_per_token(mc.num_parameters(), mc.num_hidden_layers, mc.hidden_size,
                                   cfg.seq_len)
    tps = sorted(s["tokens_per_s"] for s in steps)[len(steps) // 2]
    achieved = tps * fpt
    peak = peak_flops("cuda", cfg.dtype) if _gpu() else None
    name = torch.cuda.get_device_name() if _gpu() else "CPU"
    out = {"status": PASS if achieved > 0 else FAIL, "model": cfg.model, "dtype": cfg.dtype,
           "tokens_per_s": tps, "achieved_flops": achieved, "peak_flops": peak,
           "mfu": achieved / peak if peak else None}
    out["detail"] = (f"{cfg.model} {cfg.dtype}: {achieved / 1e12:.3f} TFLOP/s achieved"
                     + (f", peak {peak / 1e12:.0f} TFLOP/s ({name} {cfg.dtype}): MFU "
                        f"{achieved / peak:.1%}" if peak else
                        f"; no peak figure for {name} {cfg.dtype}, MFU not computed"))
    return out


def check_paged_attention_bandwidth(quick: bool) -> dict:
    from llmlab.inference.paged_attention import paged_attention_reference
    from llmlab.kernels.bench import peak_bandwidth
    if _gpu():
        _need_triton()
        from llmlab.kernels.paged_attention import paged_attention_triton as fn
        bs, H, Hkv, D, S, ctx, dtype = 16, 32, 8, 128, 64, 2048 if quick else 4096, torch.float16
        impl = "Triton"
    else:
        fn, impl = paged_attention_reference, "the PyTorch reference; the interpreter is not timed"
        bs, H, Hkv, D, S, ctx, dtype = 16, 8, 2, 64, 8, 256 if quick else 1024, torch.float32
    args = paged_case(bs, H, Hkv, D, [ctx] * S, [1] * S, dtype)
    sync = torch.cuda.synchronize if _gpu() else (lambda: None)
    for _ in range(2):  # warm-up: compilation / autotuning out of the timing
        fn(*args)
    sync()
    iters = 5 if quick else 20
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    sync()
    dt = (time.perf_counter() - t0) / iters
    kv_bytes = 2 * S * ctx * Hkv * D * args[1].element_size()
    bw = kv_bytes / dt
    peak = peak_bandwidth() if _gpu() else None
    out = {"status": PASS, "impl": impl, "kv_bytes": kv_bytes, "time_s": dt,
           "bandwidth_GBps": bw / 1e9, "peak_GBps": peak / 1e9 if peak else None,
           "detail": f"decode over {S} x {ctx} tokens, {impl}: {bw / 1e9:.1f} GB/s of K/V read"
                     + (f", {bw / peak:.0%} of the {peak / 1e9:.0f} GB/s peak" if peak else
                        ", no peak figure for this device")}
    return out


# --------------------------------------------------------------------------------------------
# Runner: one process per check
# --------------------------------------------------------------------------------------------
# name -> (check, timeout full s, timeout quick s)
CHECKS: dict[str, tuple[Callable[[bool], dict], float, float]] = {
    "flash_attention_fwd": (check_flash_attention_fwd, 180, 60),
    "flash_attention_bwd": (check_flash_attention_bwd, 240, 60),
    "fused_rmsnorm": (check_fused_rmsnorm, 120, 45),
    "fused_swiglu": (check_fused_swiglu, 120, 45),
    "paged_attention_decode": (check_paged_attention_decode, 180, 60),
    "paged_attention_prefill": (check_paged_attention_prefill, 180, 60),
    "engine_greedy_vs_hf": (check_engine_greedy_vs_hf, 180, 60),
    "engine_device_vs_cpu": (check_engine_device_vs_cpu, 300, 120),
    "train_one_device": (check_train_one_device, 240, 60),
    "train_layouts": (check_train_layouts, 480, 150),
    "collectives": (check_collectives, 180, 60),
    "mfu": (check_mfu, 180, 60),
    "paged_attention_bandwidth": (check_paged_attention_bandwidth, 120, 45),
}


def run_check_here(name: str, quick: bool) -> dict:
    """Run one check in this process: its result dict (``status`` PASS/FAIL/SKIP, ...)."""
    fn = CHECKS[name][0]
    try:
        return fn(quick)
    except Skip as e:
        return {"status": SKIP, "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - a check's error is its verdict
        import traceback
        return {"status": FAIL, "reason": f"{type(e).__name__}: {e}"[:1000],
                "traceback": traceback.format_exc()[-3000:]}


def _child_entry(name: str, quick: bool, path: str, env: dict) -> None:
    from llmlab.runtime.launch import _die_with_parent
    os.setsid()  # its own process group: a timeout kills the check and every rank it started
    _die_with_parent()  # and it dies with the fork server, which dies with the doctor
    log = os.open(path + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # progress bars and warnings go to the check's log, not between the lines
    os.dup2(log, 2)
    triton = sys.modules.get("triton")  # (Triton reads TRITON_INTERPRET when asked, but its
    built_for_gpu = triton is not None and not triton.knobs.runtime.interpret  # builtins at import)
    os.environ.update(env)  # TRITON_INTERPRET must be set before triton is first imported
    if built_for_gpu and not _gpu():
        # the fork server imported triton before TRITON_INTERPRET was set: a fresh interpreter
        os.execv(sys.executable, [sys.executable, "-m", "llmlab.selftest", name, "--result", path]
                 + (["--quick"] if quick else []))
    res = run_check_here(name, quick)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, default=str)
    os.replace(path + ".tmp", path)


def run_check(name: str, quick: bool, timeout: float | None = None) -> dict:
    """Run one check in its own process (forked from the launcher's fork server, which has torch
    imported already) and kill its process group at ``timeout`` s (then: FAIL, "hang"). Returns
    the check's result with ``seconds`` added."""
    from llmlab.runtime.launch import _context, _main_module_hidden
    timeout = timeout or CHECKS[name][2 if quick else 1]
    env = dict(os.environ)
    if not _gpu():
        env.setdefault("TRITON_INTERPRET", "1")
    fd, path = tempfile.mkstemp(prefix="llmlab-selftest-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    t0 = time.perf_counter()
    proc = _context().Process(target=_child_entry, args=(name, quick, path, env),
                              name=f"llmlab-selftest-{name}")
    try:
        with _main_module_hidden():
            proc.start()
        proc.join(timeout)
        seconds = time.perf_counter() - t0
        if proc.exitcode is None:
            return {"status": FAIL, "seconds": seconds, "log_tail": _tail(path + ".log"),
                    "pid": proc.pid,
                    "reason": f"hang: no result after {timeout:.0f} s (process group killed)"}
        if not os.path.exists(path):
            return {"status": FAIL, "seconds": seconds, "log_tail": _tail(path + ".log"),
                    "reason": f"the check process died (exit code {proc.exitcode}) without a result"}
        with open(path) as f:
            res = json.load(f)
        res["seconds"] = seconds
        return res
    finally:
        _kill_group(proc)
        for p in (path, path + ".log"):
            if os.path.exists(p):
                os.unlink(p)


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-n:])
    except OSError:
        return ""


def _kill_group(proc) -> None:
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.join(5)


def format_line(name: str, r: dict) -> str:
    what = r.get("detail", "") if r["status"] == PASS else r.get("reason", "")
    if r["status"] == PASS and r.get("note"):
        what += f" ({r['note']})"
    return f"{r['status']:<4}  {name:<26} {r.get('seconds', 0):6.1f}s  {what}"


def run_selftest(quick: bool = False, json_path: str | None = None, only: list[str] | None = None,
                 echo: Callable[[str], None] = print) -> dict:
    """Run the checks (``only``: a subset, by name) one process each; echo one line per check.
    Returns ``{"checks", "hardware", "quick", "seconds", "ok"}`` and writes it to ``json_path``.
    Raises ``ValueError`` for an unknown check name."""
    from llmlab.doctor import hardware
    names = list(only) if only else list(CHECKS)
    for n in names:
        if n not in CHECKS:
            raise ValueError(f"no self-test check named {n!r}; checks: {', '.join(CHECKS)}")
    hw = hardware()
    kernels = ("kernels in Triton's interpreter" if importlib.util.find_spec("triton")
               else "no Triton: kernel checks skipped")
    where = (f"{len(hw['gpus'])} x {hw['gpus'][0]['name']}" if hw["gpus"] else
             f"CPU only, {hw['cpu_cores']} cores ({kernels})")
    echo(f"llmlab self-test{' (quick)' if quick else ''}: {where}, torch {hw['torch']}")
    if not hw["gpus"]:  # the kernels run in Triton's interpreter, chosen before triton's import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.perf_counter()
    checks = {}
    for n in names:
        checks[n] = run_check(n, quick)
        echo(format_line(n, checks[n]))
    total = time.perf_counter() - t0
    failed = [n for n, r in checks.items() if r["status"] == FAIL]
    counts = {s: sum(r["status"] == s for r in checks.values()) for s in (PASS, FAIL, SKIP)}
    echo(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped in {total:.0f} s"
         + (f"; failed: {', '.join(failed)} (see docs/workshop.md, 'Self-test')" if failed else ""))
    report = {"checks": checks, "hardware": hw, "quick": quick, "seconds": total,
              "ok": not failed}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def _main(argv: list[str]) -> int:
    """``python -m llmlab.selftest NAME [--quick]``: one check in this process (for debugging)."""
    name, quick = argv[0], "--quick" in argv[1:]
    if not _gpu():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    res = run_check_here(name, quick)
    if "--result" in argv:  # re-executed by _child_entry: the result goes to its file
        path = argv[argv.index("--result") + 1]
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, default=str)
        os.replace(path + ".tmp", path)
        return 0
    print(format_line(name, res))
    if res["status"] == FAIL and res.get("traceback"):
        print(res["traceback"])
    return 1 if res["status"] == FAIL else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
