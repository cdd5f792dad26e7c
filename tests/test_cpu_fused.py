"""The fused C++ operators for CPU tensors (llmlab.kernels.cpu_fused) equal the PyTorch reference
they replace: RMSNorm with and without the residual add, SiLU-and-multiply, rotary embedding in
place on strided rows; fp32 to its rounding and bf16 to the last bit (the same roundings; a rare
one-ulp difference where the sum order or the exp's last bit tips a rounding); inside the engine
the fp32 greedy tokens are unchanged. Built on first use (a C++ compiler and ninja, which the
`dev` extra brings); a missing one fails these tests rather than skipping them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import llmlab.kernels as K
from llmlab.inference import LLM, SamplingParams
from llmlab.kernels import cpu_fused as C
from cpu_levels import level_fixture
from llmlab.model.layers import RMSNorm
from llmlab.model.llama import LlamaForCausalLM, rotary_cos_sin
from tiny_llama import TINY

level = level_fixture(C)


DTYPES = [torch.float32, torch.bfloat16]


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # bf16: equal but for rare one-ulp roundings
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_the_residual_add(dtype, level):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    r = torch.randn(37, 576, generator=g).to(dtype)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = (torch.rand(576, generator=g) + 0.5).to(dtype)
    _close(C.rms_norm(x, norm.weight, 1e-5), norm(x), dtype)
    out, s = C.rms_norm(x[None], norm.weight, 1e-5, residual=r[None])
    assert out.shape == s.shape == (1, 37, 576) and out.dtype == dtype
    assert torch.equal(s[0], x + r)  # the sum rounds as PyTorch's add does
    _close(out[0], norm(x + r), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype, level):
    gu = (torch.randn(2, 9, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = gu.split(1536, dim=-1)  # views of the fused projection's output
    got = C.silu_mul(gate, up)
    assert got.shape == (2, 9, 1536) and got.dtype == dtype
    _close(got, F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_the_fused_projection(dtype, level):
    # q|k heads as the serving path views them: rows of the fused q/k/v output, strided
    N, H, Hkv, D = 11, 9, 3, 64
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=torch.Generator().manual_seed(2)).to(dtype)
    qk = qkv.as_strided((N, H + Hkv, D), (qkv.stride(0), D, 1))
    cos, sin = rotary_cos_sin(torch.arange(100, 100 + N), D, 10000.0, dtype)
    c, s = cos[:, None], torch.cat([-sin[..., : D // 2], sin[..., D // 2 :]], dim=-1)[:, None]
    want = qk * c + qk.roll(D // 2, dims=-1) * s  # llmlab.model.llama.Attention._serve
    v = qkv[:, (H + Hkv) * D :].clone()
    assert C.rotary_(qk, cos, sin) is qk and K.rotary(qk, cos, sin) is not qk
    _close(qk, want, dtype)
    assert torch.equal(qkv[:, (H + Hkv) * D :], v)  # V's columns untouched


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_quantize_per_token_equals_the_reference_bit_for_bit(dtype, level):
    from llmlab.kernels.int8_linear import quantize_per_token

    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 576, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    x[3], x[5, 7] = 0.0, 1e4  # an all-zero token, and one outlier setting its row's range
    x[6] = x[6].clamp(-15, 15)  # scale 15.875 / 127 = 1/8: the ties below are exact in every dtype
    x[6, :5] = torch.tensor([15.875, 0.0625, -0.0625, 0.1875, -0.3125])  # 127, +-0.5, 1.5, -2.5 steps
    x = x.to(dtype)
    q, s = C.quantize_per_token(x[None, :, :])  # any leading shape: rows of the last dimension
    want_q, want_s = quantize_per_token(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (37, 1)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    assert q[6, :5].tolist() == [127, 0, 0, 2, -2]  # ties round to even, as torch.round does
    assert q[5, 7] == 127 and q[3].abs().sum() == 0 and torch.isfinite(s).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_is_the_first_maximum_and_flags_non_finite_rows(dtype, level):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 2 * 49152, generator=g).to(dtype)[:, :49152]  # strided rows, a real vocabulary
    x[1, 30000] = x[1, 20] = 50.0  # a tie: the first index wins, as argmax's
    x[2, 0] = 60.0  # the maximum at index 0
    x[3, 77], x[4, 5], x[5, 6] = float("nan"), float("inf"), float("-inf")
    idx, finite = C.argmax_rows(x)
    assert idx.dtype == torch.int64 and finite.dtype == torch.bool and idx.shape == finite.shape == (9,)
    assert finite.tolist() == [True, True, True, False, False, False, True, True, True]
    ok = finite.nonzero().flatten()
    assert torch.equal(idx[ok], x[ok].float().argmax(-1))
    assert idx[1] == 20 and idx[2] == 0 and idx[~finite].tolist() == [0, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_equals_the_index_copy_reference(dtype, level):
    from llmlab.inference.paged_attention import write_kv

    N, H, Hkv, D, nb, bs = 7, 9, 3, 64, 5, 4
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=torch.Generator().manual_seed(5)).to(dtype)
    k = qkv.as_strided((N, Hkv, D), (qkv.stride(0), D, 1), H * D)  # views of the fused output
    v = qkv.as_strided((N, Hkv, D), (qkv.stride(0), D, 1), (H + Hkv) * D)
    slots = torch.tensor([3, 17, 0, 19, 8, 9, 12])
    want = torch.randn(2, nb, bs, Hkv, D).to(dtype)
    got = want.clone()
    write_kv(want[0], want[1], k, v, slots)
    C.write_kv(got[0], got[1], k, v, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match=r"slot 20 outside the cache's \[0, 20\)"):
        C.write_kv(got[0], got[1], k, v, torch.tensor([3, 17, 0, 20, 8, 9, 12]))


def test_bad_inputs_name_the_constraint():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\]"):
        C.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="one dtype"):
        C.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        C.silu_mul(torch.randn(4, 7), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        C.silu_mul(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[3, 8\]"):
        C.rotary_(torch.randn(3, 2, 8), torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="one dtype"):
        C.write_kv(
            torch.zeros(2, 4, 1, 8),
            torch.zeros(2, 4, 1, 8),
            x[:, None],
            x[:, None].bfloat16(),
            torch.arange(4),
        )
    with pytest.raises(RuntimeError, match="V > 0 contiguous"):
        C.argmax_rows(x.t())


def test_the_switch_reaches_the_model():
    x = torch.randn(3, 16)
    assert not K.use_fused("rmsnorm", x)
    with K.use(cpu_fused=True):
        assert K.use_fused("rmsnorm", x) and K.use_fused("swiglu", x) and K.use_fused("rotary", x)
        norm = RMSNorm(16)
        torch.testing.assert_close(norm(x), K.rms_norm_reference(x, norm.weight, norm.eps))
    assert K.settings().cpu_fused is False


def test_engine_tokens_equal_without_the_fused_ops(level):
    cfg = dataclasses.replace(TINY, vocab_size=96)
    model = LlamaForCausalLM(cfg, seed=3)
    prompts = [[1, 5, 9, 2, 7] * k for k in (1, 3, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def tokens():
        llm = LLM(
            model, block_size=8, dtype=torch.float32, max_num_batched_tokens=24, enable_chunked_prefill=True
        )
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    want = tokens()
    with K.use(cpu_fused=True):
        assert tokens() == want
