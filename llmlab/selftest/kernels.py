"""Self-test checks of the Triton kernels against their PyTorch references, and paged decode's
measured K/V bandwidth (see :mod:`llmlab.selftest`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from llmlab.selftest.common import BF16_INTERPRETER, FAIL, PASS, Skip, _dev, _gpu


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _need_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        raise Skip('triton is not installed: pip install -e ".[kernels]"') from None


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
            f"{k} {v['err']:.2e} > {v['tol']:.0e}" for k, v in bad.items()
        )
    if note:
        out["note"] = note
    return out


def _attn_inputs(dtype, quick, grad):
    if _gpu():
        B, H, Hk, T, D = (1, 4, 2, 256, 64) if quick else (2, 8, 2, 1024, 64)
    else:
        B, H, Hk, T, D = (1, 2, 1, 20, 16) if quick else (1, 2, 1, 37, 16)
    g = torch.Generator().manual_seed(T)
    return [torch.randn(B, h, T, D, generator=g).to(_dev(), dtype).requires_grad_(grad) for h in (H, Hk, Hk)]


def check_flash_attention_fwd(quick: bool) -> dict:
    _need_triton()
    from llmlab.kernels.flash_attention import flash_attention
    from llmlab.kernels.reference import attention_reference

    dtypes, note = _dtypes(dot=True)
    errs = {}
    for dtype in dtypes:
        for causal in (True, False):
            q, k, v = _attn_inputs(dtype, quick, grad=False)
            out = flash_attention(
                q, k, v, causal, block_m=16 if not _gpu() else 64, block_n=16 if not _gpu() else 64
            )
            ref = attention_reference(q.float(), k.float(), v.float(), causal)
            e = _err(out, ref)
            errs[f"{_name(dtype)}{'' if causal else ' non-causal'}"] = {
                "err": e,
                "tol": TOL[dtype],
                "ok": e <= TOL[dtype] and out.dtype == dtype,
            }
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
        want = torch.autograd.grad(attention_reference(q32, k32, v32, True), (q32, k32, v32), dout.float())
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
        write_kv(
            k_cache, v_cache, k, v, torch.tensor(slot_mapping(table, range(ctx), block_size), device=dev)
        )
        tables.append(table + [0] * (max(nblk) - nb))
    q = torch.randn(sum(query_lens), H, D, generator=g).to(dev, dtype)
    return [
        q,
        k_cache,
        v_cache,
        torch.tensor(tables, device=dev),
        torch.tensor(ctx_lens, device=dev),
        torch.tensor(query_lens, device=dev),
    ]


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
# Measurement: paged decode's K/V bandwidth
# --------------------------------------------------------------------------------------------
def check_paged_attention_bandwidth(quick: bool) -> dict:
    from llmlab.inference.paged_attention import paged_attention_reference
    from llmlab.kernels.bench import peak_bandwidth

    fn: Callable[..., torch.Tensor]
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
    out = {
        "status": PASS,
        "impl": impl,
        "kv_bytes": kv_bytes,
        "time_s": dt,
        "bandwidth_GBps": bw / 1e9,
        "peak_GBps": peak / 1e9 if peak else None,
        "detail": f"decode over {S} x {ctx} tokens, {impl}: {bw / 1e9:.1f} GB/s of K/V read"
        + (
            f", {bw / peak:.0%} of the {peak / 1e9:.0f} GB/s peak"
            if peak
            else ", no peak figure for this device"
        ),
    }
    return out
