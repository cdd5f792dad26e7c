"""The AMX bf16 linear for decode-sized batches (llmlab.kernels.amx_linear) equals the product it
replaces: fp32 sums of bf16 inputs, rounded once to bf16, for 1-48 rows and the shapes of a real
model; cpu_linear takes it for small batches only (not with a bias, not above 48 rows) and falls
back to oneDNN where it cannot run: on a CPU without AMX, and with LLMLAB_CPU_ISA lowered below
AVX512-BF16 (whose build has no AMX code), even for a weight packed before the level was lowered.
On a CPU without AMX the kernel's own cases check that nothing attaches the AMX copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels import amx_linear as A
from llmlab.kernels import cpu_isa, cpu_linear
from packed_paths import check_failed_build, engine_outputs

HAS_AMX = {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_isa.effective_flags()  # (LLMLAB_CPU_ISA at import)


def _within_bf16(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.float() @ w.float().T  # exact products, fp32 sums
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # one bf16 rounding of the result, plus the fp32 sums' order
    bound = want.abs() * 2**-8 + 1e-4 * want.abs().max()
    assert ((got.float() - want).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 48])
@pytest.mark.parametrize("out_in", [(3072, 576), (576, 1536), (960, 576), (64, 32)])
def test_kernel_equals_fp32_sums_rounded_once(rows, out_in):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(*out_in, generator=g).bfloat16()
    x = torch.randn(rows, out_in[1], generator=g).bfloat16()
    assert A.available() == HAS_AMX
    if not HAS_AMX:  # no AMX here: the packing never attaches the tiles
        cpu_linear.pack(w)
        assert not hasattr(w, "_amx")
        return
    _within_bf16(A.linear(x, A.pack(w)), x, w)
    y3 = A.linear(x[None], A.pack(w))  # leading dimensions, as the model's [1, N, in]
    assert y3 is not None and y3.shape == (1, rows, out_in[0])


@pytest.mark.skipif(
    not HAS_AMX, reason="the AMX dispatch: no AMX at this level (the case above checks the fallback)"
)
def test_cpu_linear_takes_it_for_small_unbiased_batches_only(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    cpu_linear.pack(w)
    assert hasattr(w, "_amx") and w._amx.shape == (6, 2, 16, 16, 2)
    calls = []
    real = A.linear
    monkeypatch.setattr(A, "linear", lambda x, p: calls.append(x.shape) or real(x, p))
    for rows in (1, 48, 49, 300):
        x = torch.randn(1, rows, 64, generator=g).bfloat16()
        torch.testing.assert_close(
            cpu_linear.linear(x, w).float(), F.linear(x, w).float(), atol=0.1, rtol=2e-2
        )
    b = torch.randn(96, generator=g).bfloat16()
    torch.testing.assert_close(
        cpu_linear.linear(x[:, :3], w, b).float(), F.linear(x[:, :3], w, b).float(), atol=0.1, rtol=2e-2
    )
    assert calls == [(1, 1, 64), (1, 48, 64)]  # 49 and 300 rows, and the biased call: oneDNN


@pytest.mark.skipif(not HAS_AMX, reason="lowering the level from a CPU with AMX")
def test_a_lowered_level_takes_onednn_even_for_a_weight_packed_before(monkeypatch):
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    cpu_linear.pack(w)
    assert hasattr(w, "_amx")
    monkeypatch.setenv(cpu_isa.ENV, "avx512")  # x86-64-v4: no AMX in that build
    assert A.isa() == "avx512" and not A.available()
    x = torch.randn(3, 64).bfloat16()
    assert A.linear(x, w._amx) is None  # the caller's other path
    torch.testing.assert_close(cpu_linear.linear(x, w).float(), F.linear(x, w).float(), atol=0.1, rtol=2e-2)
    w2 = torch.randn(64, 64).bfloat16()
    cpu_linear.pack(w2)
    assert hasattr(w2, "_packed") and not hasattr(w2, "_amx")


@pytest.mark.skipif(not HAS_AMX, reason="the kernel's own errors: no AMX at this level")
def test_bad_inputs_name_the_constraint():
    with pytest.raises(RuntimeError, match="multiples of 32"):
        A.pack(torch.zeros(40, 64, dtype=torch.bfloat16))
    p = A.pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="1 to 48 rows, got 49"):
        A.linear(torch.zeros(49, 64, dtype=torch.bfloat16), p)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        A.linear(torch.zeros(2, 32, dtype=torch.bfloat16), p)
    assert not A.fits(torch.zeros(32, 64)) and not A.fits(torch.zeros(40, 64, dtype=torch.bfloat16))


def test_bf16_engine_logits_with_the_amx_path_equal_onednn_to_rounding(monkeypatch):
    out = engine_outputs(monkeypatch, A, torch.bfloat16, "_amx", HAS_AMX)
    for a, b in zip(*out):
        assert len(a.outputs[0].token_ids) == len(b.outputs[0].token_ids) == 8
        # bf16: the two summation orders may flip a near-tie; the first token's logprobs agree
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        common = set(la) & set(lb)
        assert len(common) >= 3 and all(abs(la[t].logprob - lb[t].logprob) < 0.05 for t in common)


def test_a_failed_build_warns_once_and_leaves_the_products_on_onednn(monkeypatch):
    check_failed_build(monkeypatch, A, {"amx_bf16", "amx_tile", "avx512_bf16"}, torch.bfloat16, "_amx")
