"""The fp32 panel linear for decode-sized batches (llmlab.kernels.panel_linear) equals F.linear to
fp32 rounding: 1-64 rows (and more, in row chunks), the shapes of a real model, shapes that are
not multiples of the panel or of two inputs, with and without a bias; cpu_linear takes it for 1-64
rows only and falls back to oneDNN where it cannot run: with LLMLAB_CPU_ISA lowered to AVX2 (whose
build has no AVX-512 code), even for a weight packed before the level was lowered, and where the
build fails. On a CPU without AVX-512 the kernel's own cases check that nothing attaches the
panels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels import cpu_isa, cpu_linear
from llmlab.kernels import panel_linear as P
from packed_paths import check_failed_build, engine_outputs

HAS_AVX512 = "avx512f" in cpu_isa.effective_flags()  # (LLMLAB_CPU_ISA at import)


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == want.shape
    # fp32 sums of K products in another order: a few ulps of the largest partial sums
    scale = (x.double().abs() @ w.double().abs().T).max()
    assert (got.double() - want).abs().max() <= 1e-6 * scale + 1e-6


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40, 64, 97, 200])
@pytest.mark.parametrize("out_in", [(3072, 576), (576, 1536), (960, 576), (33, 17), (5, 3), (70, 1)])
def test_kernel_equals_f_linear_to_fp32_rounding(rows, out_in):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(*out_in, generator=g)
    x = torch.randn(rows, out_in[1], generator=g)
    b = torch.randn(out_in[0], generator=g)
    assert P.available() == HAS_AVX512
    if not HAS_AVX512:  # no AVX-512 here: the packing never attaches the panels
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


@pytest.mark.skipif(
    not HAS_AVX512, reason="the panel dispatch: no AVX-512 at this level (the case above checks the fallback)"
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
    assert not hasattr(wb, "_panels")  # fp32 only


@pytest.mark.skipif(not HAS_AVX512, reason="lowering the level from a CPU with AVX-512")
def test_a_lowered_level_takes_onednn_even_for_a_weight_packed_before(monkeypatch):
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    cpu_linear.pack(w)
    assert hasattr(w, "_panels")
    monkeypatch.setenv(cpu_isa.ENV, "avx2")  # x86-64-v3: no AVX-512 in that build
    assert P.isa() == "avx2" and not P.available()
    x = torch.randn(3, 48)
    assert P.linear(x, w._panels, 64) is None  # the caller's other path
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    w2 = torch.randn(64, 48)
    cpu_linear.pack(w2)
    assert hasattr(w2, "_packed") and not hasattr(w2, "_panels")


@pytest.mark.skipif(not HAS_AVX512, reason="the kernel's own errors: no AVX-512 at this level")
def test_bad_inputs_name_the_constraint():
    with pytest.raises(RuntimeError, match=r"non-empty fp32 CPU tensor \[out, in\], got BFloat16 \[40, 64\]"):
        P.pack(torch.zeros(40, 64, dtype=torch.bfloat16))
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
        RuntimeError, match=r"x must be an fp32 CPU tensor \[rows, in\], got Double \[2, 64\]"
    ):
        P.linear(torch.zeros(2, 64, dtype=torch.float64), p, 40)
    assert not P.fits(torch.zeros(32, 64).bfloat16()) and not P.fits(torch.zeros(0, 64))


def test_fp32_engine_with_the_panel_path_equals_onednn(monkeypatch):
    out = engine_outputs(monkeypatch, P, torch.float32, "_panels", HAS_AVX512)
    for a, b in zip(*out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 8
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(la) == set(lb)
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


def test_a_failed_build_warns_once_and_leaves_the_products_on_onednn(monkeypatch):
    check_failed_build(monkeypatch, P, {"avx512f"}, torch.float32, "_panels")
