"""Self-test checks of the CPU fast paths against their PyTorch references, each reporting which
path ran on this CPU (:mod:`llmlab.kernels.cpu_isa`: the level it chose by, ``LLMLAB_CPU_ISA``
lowering it):

* ``cpu_packed_linear``: the oneDNN-prepacked linear (:mod:`llmlab.kernels.cpu_linear`) against
  ``F.linear`` in fp32, bf16 and fp16, with the path each dtype took (``onednn``; ``onednn-fp32``,
  the weight widened to fp32, where the CPU cannot pack that dtype; ``aten`` without oneDNN), and
  decode-sized batches in bf16 (``amx`` where the CPU has AMX tiles:
  :mod:`llmlab.kernels.amx_linear`; ``panels`` where it has AVX512-BF16; ``fp32 panels`` where
  the weight is widened) and in fp32 (``panels`` where it has AVX2:
  :mod:`llmlab.kernels.panel_linear`), and the fp32 lm_head's greedy tokens screened in
  bf16 where it has AVX512-BF16 (``bf16 screen``: :mod:`llmlab.inference.greedy_screen`) against
  the full product's argmax;
* ``cpu_paged_attention``: the C++ PagedAttention against the reference, prefill and decode rows
  in one call, fp32 and bf16, with the vector code the build uses (``avx512_bf16``: bf16 pair dot
  products; ``avx512``, ``avx2``, ``generic``: fp32-widening);
* ``cpu_fused_ops``: the C++ RMSNorm (with the residual add), SiLU-and-multiply and rotary against
  the model's PyTorch code, fp32 and bf16.

A fast path whose result leaves its tolerance is a FAIL: the engine would serve wrong tokens with
it. The C++ checks SKIP where the kernels cannot be built (no C++ compiler or ninja).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.selftest.common import Skip
from llmlab.selftest.kernels import _err, _name, _verdict, paged_case

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _level() -> dict:
    from llmlab.kernels import cpu_isa

    return {"cpu_isa": cpu_isa.cpu_isa(), "detected_isa": cpu_isa.detected()}


def _record(errs: dict, key: str, got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    e = _err(got, want)
    errs[key] = {"err": e, "tol": TOL[dtype], "ok": e <= TOL[dtype]}


def check_cpu_packed_linear(quick: bool) -> dict:
    from llmlab.kernels import cpu_linear

    rows = (1, 9) if quick else (1, 9, 64, 300)
    errs: dict[str, dict] = {}
    paths: dict[str, str] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        paths[_name(dtype)] = cpu_linear.path(dtype)
        g = torch.Generator().manual_seed(5)
        w = (torch.randn(96, 80, generator=g) * 0.1).to(dtype)
        b = torch.randn(96, generator=g).to(dtype)
        cpu_linear.pack(w)
        if dtype == torch.float32:  # decode-sized batches: in panels where the CPU has AVX2
            paths["fp32 small batches"] = "panels" if hasattr(w, "_panels") else paths["fp32"]
        for n in rows:
            x = torch.randn(n, 80, generator=g).to(dtype)
            want = F.linear(x.float(), w.float(), b.float())
            _record(errs, f"{_name(dtype)} x{n}", cpu_linear.linear(x, w, b), want, dtype)
    # bf16 decode-sized batches, no bias: on AMX tiles where the CPU has them (amx_linear), else
    # in panels where it has AVX512-BF16 (panel_linear), else widened in fp32 panels (AVX2)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    cpu_linear.pack(w)
    panels = getattr(w, "_panels", None)
    if hasattr(w, "_amx"):
        paths["bf16 small batches"] = "amx"
    elif panels is None:
        paths["bf16 small batches"] = paths["bf16"]
    else:  # (fp32 panels: the weight widened, where oneDNN cannot pack bf16)
        paths["bf16 small batches"] = "panels" if panels.dtype == torch.bfloat16 else "fp32 panels"
    for n in rows[:2]:
        x = torch.randn(n, 64, generator=g).bfloat16()
        want = F.linear(x.float(), w.float())
        _record(errs, f"bf16 x{n} no bias", cpu_linear.linear(x, w), want, torch.bfloat16)
    _greedy_screen(errs, paths, g)
    out = _verdict(errs, None, paths=paths, **_level())
    out["detail"] = (
        f"{_level()['cpu_isa']}: "
        + ", ".join(f"{k} {v}" for k, v in paths.items())
        + f"; max err {max(v['err'] for v in errs.values()):.1e}"
    )
    return out


def _greedy_screen(errs: dict, paths: dict, g: torch.Generator) -> None:
    """The fp32 lm_head's greedy tokens screened in bf16 (llmlab.inference.greedy_screen, where
    the CPU has AVX512-BF16) against the full product's argmax: any token off is a FAIL."""
    from llmlab.inference.greedy_screen import GreedyScreen

    w = torch.randn(1000, 64, generator=g)
    if not GreedyScreen.applies(w):
        paths["fp32 greedy lm_head"] = "full product"
        return
    paths["fp32 greedy lm_head"] = "bf16 screen"
    h = torch.randn(9, 64, generator=g) * 4
    found = GreedyScreen(w).argmax(h)
    want = (h @ w.T).argmax(1).tolist()
    off = len(want) if found is None else sum(t != x or not ok for t, ok, x in zip(*found, want))
    errs["fp32 greedy screen tokens off"] = {"err": float(off), "tol": 0.0, "ok": off == 0}


def _need_cxx() -> None:
    from llmlab.kernels.cpu_build import available

    if not available():
        raise Skip('the C++ CPU kernels need a C++ compiler and ninja (pip install "llmlab[cpu-kernels]")')


def check_cpu_paged_attention(quick: bool) -> dict:
    _need_cxx()
    from llmlab.inference.paged_attention import paged_attention_reference
    from llmlab.kernels import cpu_paged_attention as C

    ctx = [9, 33, 1] if quick else [9, 33, 1, 70, 128]
    qlens = [9, 5] + [1] * (len(ctx) - 2)  # a prompt, a chunk, decodes
    errs: dict[str, dict] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for D in (64, 48):  # 48: not a multiple of 32 (widening path)
            args = paged_case(8, 6, 2, D, ctx, qlens, dtype, seed=D)
            want = paged_attention_reference(*(a.float() if a.is_floating_point() else a for a in args))
            _record(errs, f"{_name(dtype)} D{D}", C.paged_attention_cpu(*args), want, dtype)
    isa = C.isa()
    out = _verdict(errs, None, build_isa=isa, **_level())
    out["detail"] = f"C++ build {isa}; " + out["detail"]
    return out


def check_cpu_fused_ops(quick: bool) -> dict:
    _need_cxx()
    from llmlab.kernels import cpu_fused as C
    from llmlab.kernels.reference import rms_norm_reference, swiglu_reference
    from llmlab.model.llama import rotary_cos_sin

    n, h = (7, 96) if quick else (37, 576)
    errs: dict[str, dict] = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(6)
        x, r, gate, up = (torch.randn(n, h, generator=g).to(dtype) for _ in range(4))
        w = (torch.rand(h, generator=g) + 0.5).to(dtype)
        normed, total = C.rms_norm(x, w, 1e-5, residual=r)
        ref_total = x.float() + r.float()
        _record(
            errs, f"{_name(dtype)} rms_norm", normed, rms_norm_reference(ref_total, w.float(), 1e-5), dtype
        )
        _record(errs, f"{_name(dtype)} residual", total, ref_total, dtype)
        _record(
            errs,
            f"{_name(dtype)} silu_mul",
            C.silu_mul(gate, up),
            swiglu_reference(gate.float(), up.float()),
            dtype,
        )
        q = torch.randn(n, 3, 32, generator=g).to(dtype)
        cos, sin = rotary_cos_sin(torch.arange(n), 32, 10000.0, torch.float32)
        sign = torch.cat([-sin[:, :16], sin[:, 16:]], dim=-1)[:, None]
        want = q.float() * cos[:, None] + q.float().roll(16, dims=-1) * sign
        _record(
            errs, f"{_name(dtype)} rotary", C.rotary_(q.clone(), cos.to(dtype), sin.to(dtype)), want, dtype
        )
    isa = C.isa()
    out = _verdict(errs, None, build_isa=isa, **_level())
    out["detail"] = f"C++ build {isa}; " + out["detail"]
    return out
