"""The panel linear for decode-sized batches (llmlab.kernels.panel_linear) equals F.linear to
rounding: fp32 to fp32 rounding, bf16 to fp32 sums rounded once to bf16; 1-64 rows (and more, in
row chunks), the shapes of a real model, shapes that are not multiples of the panel or of two
inputs, with and without a bias. The fp32 kernel has an AVX-512 and an AVX2 build (each panel
as two halves of 16 columns), equal bit for bit; the fp32 cases run at this CPU's level and
forced to the level below (on an AVX-512 CPU: the AVX2 build; on an AVX2-only one: no kernel).
cpu_linear takes it for 1-64 rows only (bf16: where the AMX tiles do not) and falls back to
oneDNN where it cannot run: with LLMLAB_CPU_ISA lowered (x86-64: no fp32 kernel; AVX-512 without
BF16: no bf16 code), even for a weight packed before the level was lowered, and where the build
fails. On a CPU without AVX2 (or AVX512-BF16) the kernel's own cases check that nothing attaches
the panels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels import cpu_isa, cpu_linear
from llmlab.kernels import panel_linear as P
from cpu_levels import level_fixture
from packed_paths import check_failed_build, engine_outputs

FP32_FLAGS = {"avx2", "fma"}  # the fp32 kernel's AVX2 build; AVX-512 where the CPU has it
HAS_FP32 = FP32_FLAGS <= cpu_isa.effective_flags()  # (LLMLAB_CPU_ISA at import)
level = level_fixture(P)  # this CPU's level, then the one below (the build's isa() checked)


HAS_BF16 = "avx512_bf16" in cpu_isa.effective_flags()
HAS_AMX = {"amx_bf16", "amx_tile"} <= cpu_isa.effective_flags()  # bf16 weights it fits: AMX tiles


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == want.shape
    # fp32 sums of K products in another order: a few ulps of the largest partial sums
    scale = (x.double().abs() @ w.double().abs().T).max()
    assert (got.double() - want).abs().max() <= 1e-6 * scale + 1e-6


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40, 64, 97, 200])
@pytest.mark.parametrize("out_in", [(3072, 576), (576, 1536), (960, 576), (33, 17), (5, 3), (70, 1)])
def test_kernel_equals_f_linear_to_fp32_rounding(rows, out_in, level):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(*out_in, generator=g)
    x = torch.randn(rows, out_in[1], generator=g)
    b = torch.randn(out_in[0], generator=g)
    has = FP32_FLAGS <= cpu_isa.effective_flags()
    assert P.available() == has
    if not has:  # no AVX2 at this level: the packing never attaches the panels
        cpu_linear.pack(w)
        assert not hasattr(w, "_panels")
        return
    p = P.pack(w)
    assert p.shape == ((out_in[0] + 31) // 32, out_in[1], 32)
    _close(P.linear(x, p, out_in[0]), x, w, None)
    _close(P.linear(x, p, out_in[0], b), x, w, b)
    y3 = P.linear(x[None], p, out_in[0])  # leading dimensions, as the model's [1, N, in]
    assert y3 is not None and y3.shape == (1, rows, out_in[0])
    assert torch.equal(y3[0], P.linear(x, p, out_in[0]))


def _within_bf16(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = x.double() @ w.double().T + (0 if b is None else b.double())  # exact products and sums
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # one bf16 rounding of the result, plus the fp32 sums' order
    scale = (x.double().abs() @ w.double().abs().T).max()
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-6 * scale + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40, 64, 97])
@pytest.mark.parametrize("out_in", [(3072, 576), (576, 1536), (960, 576), (33, 17), (5, 3), (70, 1)])
def test_bf16_kernel_equals_fp32_sums_rounded_once(rows, out_in):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(*out_in, generator=g).bfloat16()
    x = torch.randn(rows, out_in[1], generator=g).bfloat16()
    b = torch.randn(out_in[0], generator=g).bfloat16()
    assert P.available(torch.bfloat16) == HAS_BF16
    if not HAS_BF16:  # no AVX512-BF16 here: the packing never attaches bf16 panels
        cpu_linear.pack(w)  # (a weight widened to fp32 for oneDNN gets fp32 panels where they run)
        assert getattr(w, "_panels", None) is None or w._panels.dtype == torch.float32
        return
    p = P.pack(w)
    assert p.shape == ((out_in[0] + 31) // 32, out_in[1], 32) and p.dtype == torch.bfloat16
    _within_bf16(P.linear(x, p, out_in[0]), x, w, None)
    _within_bf16(P.linear(x, p, out_in[0], b), x, w, b)
    y3 = P.linear(x[None], p, out_in[0])
    assert y3 is not None and y3.shape == (1, rows, out_in[0])
    assert torch.equal(y3[0], P.linear(x, p, out_in[0]))


@pytest.mark.skipif(
    not HAS_FP32 or cpu_isa.fallback() != "avx2",
    reason="two builds with the fp32 kernel: an AVX-512 CPU (the AVX2 one's own results are checked above)",
)
@pytest.mark.parametrize("rows", [1, 7, 13, 64])
def test_the_avx2_build_equals_the_avx512_build_bit_for_bit(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(100, 577, generator=g), torch.randn(100, generator=g)  # a half-empty last panel
    x = torch.randn(rows, 577, generator=g)
    panels = P.pack(w)
    native = P.linear(x, panels, 100, b)
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    assert P.isa() == "avx2"
    avx2 = P.linear(x, panels, 100, b)
    assert native is not None and avx2 is not None and torch.equal(native, avx2)  # FMAs in one order


@pytest.mark.skipif(
    not HAS_FP32, reason="the panel dispatch: no AVX2 at this level (the case above checks the fallback)"
)
def test_cpu_linear_takes_it_for_up_to_64_rows(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g)
    cpu_linear.pack(w)
    assert hasattr(w, "_panels") and w._panels.shape == (3, 80, 32)
    calls = []
    real = P.linear
    monkeypatch.setattr(P, "linear", lambda x, p, n, bias=None: calls.append(x.shape) or real(x, p, n, bias))
    for rows in (1, 64, 65, 300):
        x = torch.randn(1, rows, 80, generator=g)
        torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert calls == [(1, 1, 80), (1, 64, 80)]  # 65 and 300 rows: oneDNN
    wb = torch.randn(64, 64).bfloat16()
    cpu_linear.pack(wb)
    # bf16: in panels where the CPU has AVX512-BF16 and no AMX tiles take the weight; widened to
    # fp32 where oneDNN cannot pack bf16 (an AVX2-only CPU), in the fp32 panels
    widened = cpu_linear.path(torch.bfloat16) == "onednn-fp32"
    assert hasattr(wb, "_panels") == (HAS_BF16 and not HAS_AMX or widened) and hasattr(wb, "_amx") == HAS_AMX
    assert wb._panels.dtype == (torch.float32 if widened else torch.bfloat16)
    wh = torch.randn(64, 64).half()
    cpu_linear.pack(wh)
    if cpu_linear.path(torch.float16) == "onednn-fp32":  # fp16 widened: the fp32 panels
        assert wh._panels.dtype == torch.float32
    else:  # fp16 itself: never
        assert not hasattr(wh, "_panels")


@pytest.mark.skipif(not HAS_BF16 or HAS_AMX, reason="the bf16 panel dispatch: AVX512-BF16 and no AMX")
def test_cpu_linear_takes_the_bf16_panels_for_every_row_count(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    cpu_linear.pack(w)
    assert w._panels.shape == (3, 80, 32) and w._panels.dtype == torch.bfloat16
    calls = []
    real = P.linear
    monkeypatch.setattr(P, "linear", lambda x, p, n, bias=None: calls.append(x.shape) or real(x, p, n, bias))
    for rows in (1, 64, 65, 300):
        x = torch.randn(1, rows, 80, generator=g).bfloat16()
        got, want = cpu_linear.linear(x, w, b).float(), F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(got, want, atol=0.05, rtol=2e-2)
    assert calls == [(1, 1, 80), (1, 64, 80), (1, 65, 80), (1, 300, 80)]  # prefill sizes too


@pytest.mark.skipif(not HAS_FP32, reason="lowering the level from a CPU with AVX2")
def test_a_lowered_level_takes_onednn_even_for_a_weight_packed_before(monkeypatch):
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    cpu_linear.pack(w)
    assert hasattr(w, "_panels")
    monkeypatch.setenv(cpu_isa.ENV, "generic")  # x86-64: no AVX2 in that build
    assert P.isa() == "generic" and not P.available()
    x = torch.randn(3, 48)
    assert P.linear(x, w._panels, 64) is None  # the caller's other path
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    w2 = torch.randn(64, 48)
    cpu_linear.pack(w2)
    assert hasattr(w2, "_packed") and not hasattr(w2, "_panels")


@pytest.mark.skipif(not HAS_BF16, reason="lowering the level from a CPU with AVX512-BF16")
def test_a_level_without_bf16_takes_onednn_for_bf16_even_for_a_weight_packed_before(monkeypatch):
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)).bfloat16()
    w._panels = P.pack(w)  # (as the packing attaches them where no AMX tiles do)
    cpu_linear.pack(w)
    monkeypatch.setenv(cpu_isa.ENV, "avx512")  # x86-64-v4: AVX-512 without AVX512-BF16
    assert P.isa() == "avx512" and P.available() and not P.available(torch.bfloat16)
    x = torch.randn(3, 48).bfloat16()
    assert P.linear(x, w._panels, 64) is None  # the caller's other path
    torch.testing.assert_close(cpu_linear.linear(x, w).float(), F.linear(x, w).float(), atol=0.05, rtol=2e-2)
    w2 = torch.randn(64, 48).bfloat16()
    cpu_linear.pack(w2)
    assert hasattr(w2, "_packed") and not hasattr(w2, "_panels")
    w3 = torch.randn(64, 48)  # fp32 keeps its panels at that level
    cpu_linear.pack(w3)
    assert hasattr(w3, "_panels")


@pytest.mark.skipif(not HAS_FP32, reason="the kernel's own errors: no AVX2 at this level")
def test_bad_inputs_name_the_constraint():
    with pytest.raises(
        RuntimeError, match=r"non-empty fp32 or bf16 CPU tensor \[out, in\], got Half \[40, 64\]"
    ):
        P.pack(torch.zeros(40, 64, dtype=torch.float16))
    p = P.pack(torch.zeros(40, 64))
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        P.linear(torch.zeros(2, 32), p, 40)
    with pytest.raises(RuntimeError, match="65 outputs do not match 2 panels"):
        P.linear(torch.zeros(2, 64), p, 65)
    with pytest.raises(RuntimeError, match=r"bias must be fp32 \[40\], got Float \[41\]"):
        P.linear(torch.zeros(2, 64), p, 40, torch.zeros(41))
    with pytest.raises(RuntimeError, match=r"bias must be fp32 \[40\], got Float \[1, 40\]"):
        P.linear(torch.zeros(2, 64), p, 40, torch.zeros(1, 40))
    with pytest.raises(
        RuntimeError,
        match=r"x must be a CPU tensor \[rows, in\] in the weight's dtype \(fp32\), got Double \[2, 64\]",
    ):
        P.linear(torch.zeros(2, 64, dtype=torch.float64), p, 40)
    with pytest.raises(RuntimeError, match=r"weight's dtype \(fp32\), got BFloat16 \[2, 64\]"):
        P.linear(torch.zeros(2, 64, dtype=torch.bfloat16), p, 40)
    if HAS_BF16:
        pb = P.pack(torch.zeros(40, 64, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match=r"bias must be bf16 \[40\], got Float \[40\]"):
            P.linear(torch.zeros(2, 64, dtype=torch.bfloat16), pb, 40, torch.zeros(40))
    assert P.fits(torch.zeros(32, 64).bfloat16()) and not P.fits(torch.zeros(32, 64).half())
    assert not P.fits(torch.zeros(0, 64))


def test_fp32_engine_with_the_panel_path_equals_onednn(monkeypatch):
    out = engine_outputs(monkeypatch, P, torch.float32, "_panels", HAS_FP32)
    for a, b in zip(*out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 8
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(la) == set(lb)
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


def test_bf16_engine_logits_with_the_panel_path_equal_onednn_to_rounding(monkeypatch):
    widened = cpu_linear.path(torch.bfloat16) == "onednn-fp32"  # (then the fp32 panels)
    out = engine_outputs(
        monkeypatch, P, torch.bfloat16, "_panels", HAS_BF16 and not HAS_AMX or widened and HAS_FP32
    )
    for a, b in zip(*out):
        assert len(a.outputs[0].token_ids) == len(b.outputs[0].token_ids) == 8
        # bf16: the two summation orders may flip a near-tie; the first token's logprobs agree
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        common = set(la) & set(lb)
        assert len(common) >= 3 and all(abs(la[t].logprob - lb[t].logprob) < 0.05 for t in common)


def test_a_failed_build_warns_once_and_leaves_the_products_on_onednn(monkeypatch):
    check_failed_build(monkeypatch, P, FP32_FLAGS, torch.float32, "_panels")


def test_a_failed_build_leaves_bf16_products_on_onednn(monkeypatch):
    monkeypatch.setattr(cpu_linear.amx_linear, "available", lambda: False)  # (as on a CPU without AMX)
    check_failed_build(monkeypatch, P, {"avx512f", "avx512_bf16"}, torch.bfloat16, "_panels", by_dtype=True)


@pytest.mark.skipif(not HAS_BF16, reason="the SwiGLU epilogue: bf16 panels need AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 40, 100, 300])
@pytest.mark.parametrize("inter_in", [(1536, 576), (40, 33), (7, 5), (16, 64)])
def test_swiglu_epilogue_equals_the_product_then_silu_mul(rows, inter_in):
    from llmlab.kernels import cpu_fused

    inter, k = inter_in
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(2 * inter, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    fused = P.swiglu(x[None], P.pack_swiglu(w, inter), inter)
    h = P.linear(x, P.pack(w), 2 * inter)
    # the same panels' sums, rounded at the same steps: equal bit for bit
    assert fused is not None and fused.shape == (1, rows, inter)
    assert torch.equal(fused[0], cpu_fused.silu_mul(h[:, :inter], h[:, inter:]))
    with pytest.raises(ValueError, match=r"must be \[2 \* 41, in\], got \[80, 33\]|must be \[2 \* 41, in\]"):
        P.pack_swiglu(torch.zeros(80, k).bfloat16(), 41)


@pytest.mark.skipif(not HAS_BF16 or HAS_AMX, reason="the SwiGLU epilogue: bf16 panels, no AMX")
def test_bf16_engine_with_the_swiglu_epilogue_equals_it_apart(monkeypatch):
    import dataclasses

    from llmlab.inference import LLM, SamplingParams
    from llmlab.kernels import cpu_fused
    from llmlab.model.llama import LlamaForCausalLM
    from tiny_llama import TINY

    cfg = dataclasses.replace(TINY, hidden_size=64, intermediate_size=96, vocab_size=128)
    prompts = [[(7 * i + j) % 128 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    out, calls = [], []
    real = cpu_fused.silu_mul
    monkeypatch.setattr(cpu_fused, "silu_mul", lambda g, u: calls.append(g.shape) or real(g, u))
    for on in (True, False):
        with monkeypatch.context() as m:
            if not on:
                m.setattr(cpu_linear.panel_linear, "pack_swiglu", lambda w, i: None)
            llm = LLM(
                LlamaForCausalLM(cfg, seed=0),
                block_size=4,
                dtype=torch.bfloat16,
                packed_linear=True,
                cpu_fused=True,
            )
        w = llm.engine.runner.model.model.layers[0].mlp.fused_gate_up[0]
        assert (getattr(w, "_swiglu", None) is not None) == on
        calls.clear()
        out.append(llm.generate(prompts, params))
        assert bool(calls) == (not on)  # apart: the product, then silu_mul
    for a, b in zip(*out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}
    x = torch.randn(3, 64)
    assert cpu_linear.gate_up_swiglu(x, torch.randn(192, 64), None) is None  # fp32, no SwiGLU panels
