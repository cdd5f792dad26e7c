"""PyTorch references of the kernels and the model's kernel switch (no Triton needed)."""

import math

import pytest
import torch
import torch.nn.functional as F

import llmlab.kernels as K
from llmlab.kernels.online_softmax import (
    merge_softmax_partials,
    online_softmax,
    online_softmax_matmul,
    online_softmax_steps,
    softmax_partial,
)
from llmlab.kernels.reference import (
    attention_reference,
    flash_attention_reference,
    rms_norm_reference,
    swiglu_reference,
)
from llmlab.metrics.memory import SavedActivations
from llmlab.model.config import get_preset
from llmlab.model.llama import LlamaForCausalLM


@pytest.fixture(autouse=True)
def _default_kernels():
    K.disable()
    yield
    K.disable()


def _qkv(B, H, Hk, T, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=g, dtype=dtype).requires_grad_() for h in (H, Hk, Hk)]


def test_online_softmax_matches_softmax_and_running_stats():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 4
    torch.testing.assert_close(online_softmax(x, 7), torch.softmax(x, -1))
    steps = online_softmax_steps(x, 7)
    assert len(steps) == math.ceil(50 / 7) and steps[-1]["stop"] == 50
    # after each block, m and l are the max and the normaliser of the prefix seen so far
    for s in steps:
        prefix = x[:, : s["stop"]]
        torch.testing.assert_close(s["m"], prefix.amax(-1))
        torch.testing.assert_close(s["l"], torch.exp(prefix - s["m"][:, None]).sum(-1))
    assert torch.all(steps[0]["rescale"] == 0)  # exp(-inf - m): nothing summed yet
    v = torch.randn(50, 5)
    torch.testing.assert_close(online_softmax_matmul(x, v, 8), torch.softmax(x, -1) @ v)
    with pytest.raises(ValueError, match="block_size=0"):
        online_softmax_steps(x, 0)


def test_merge_softmax_partials_equals_softmax_over_the_union():
    g = torch.Generator().manual_seed(2)
    s, v = torch.randn(3, 6, 20, generator=g) * 3, torch.randn(3, 20, 4, generator=g)
    s[:, 0, :] = float("-inf")  # a row that sees no key at all
    s[:, 1, :9] = float("-inf")  # a row empty in the first part only
    out, lse = merge_softmax_partials(
        *softmax_partial(s[..., :9], v[:, :9]), *softmax_partial(s[..., 9:], v[:, 9:])
    )
    full_out, full_lse = softmax_partial(s, v)
    torch.testing.assert_close(out[:, 1:], torch.softmax(s[:, 1:], -1) @ v)
    torch.testing.assert_close(lse, full_lse)
    assert torch.all(out[:, 0] == 0) and torch.all(lse[:, 0] == float("-inf"))
    # order of the parts does not matter
    out2, _ = merge_softmax_partials(
        *softmax_partial(s[..., 9:], v[:, 9:]), *softmax_partial(s[..., :9], v[:, :9])
    )
    torch.testing.assert_close(out2, out)


@pytest.mark.parametrize(
    "B,H,Hk,T,D,bm,bn,causal",
    [
        (2, 4, 2, 37, 16, 16, 8, True),  # GQA, T not a multiple of either block
        (1, 2, 2, 5, 8, 4, 4, True),
        (1, 3, 1, 64, 32, 16, 32, True),  # T a multiple, block_m != block_n
        (2, 2, 1, 23, 8, 8, 16, False),
    ],
)
def test_flash_reference_matches_materialised(B, H, Hk, T, D, bm, bn, causal):
    q, k, v = _qkv(B, H, Hk, T, D)
    ref = attention_reference(q, k, v, causal)
    out = flash_attention_reference(q, k, v, causal, block_m=bm, block_n=bn)
    dout = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, (q, k, v), dout)
    g_out = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # and both equal PyTorch's SDPA (k, v repeated over the groups)
    rep = H // Hk
    sdpa = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal
    )
    torch.testing.assert_close(ref, sdpa, atol=2e-6, rtol=1e-5)


def test_attention_reference_rejects_bad_shapes():
    q, k, v = _qkv(1, 4, 3, 8, 8)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        attention_reference(q, k, v)
    q, k, v = _qkv(1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="T_q == T_k"):
        flash_attention_reference(q, k[:, :, :4], v[:, :, :4])
    with pytest.raises(ValueError, match="block_m=0"):
        flash_attention_reference(q, k, v, block_m=0)


def _saved_bytes(fn, q, k, v):
    with SavedActivations() as act:
        out = fn(q, k, v)
    out.sum().backward()
    return act.peak


def test_saved_memory_flash_linear_materialised_quadratic():
    B, H, D = 1, 2, 16
    flash, eager = {}, {}
    for T in (32, 64, 128):
        q, k, v = _qkv(B, H, H, T, D)
        flash[T] = _saved_bytes(lambda *a: flash_attention_reference(*a, block_m=16, block_n=16), q, k, v)
        eager[T] = _saved_bytes(attention_reference, q, k, v)
        # flash keeps q, k, v, out (fp32) and the per-row log-sum-exp: 4·B·H·T·D·4 + B·H·T·4
        assert flash[T] == 4 * B * H * T * D * 4 + B * H * T * 4
        # materialised attention keeps the fp32 probabilities [B, H, T, T], the bool causal
        # mask [T, T] and q, k, v
        assert eager[T] == 4 * B * H * T * T + T * T + 3 * B * H * T * D * 4
    assert flash[128] == pytest.approx(4 * flash[32])  # O(T)
    assert eager[128] / eager[64] > 3.0  # O(T²) dominates


def test_attention_memory_rows_match_formulas():
    from llmlab.kernels.bench import attention_memory

    rows = attention_memory((16, 40), batch=2, heads=2, head_dim=8, impls=("eager", "reference"))
    assert [(r["impl"], r["seq_len"]) for r in rows] == [
        ("eager", 16),
        ("reference", 16),
        ("eager", 40),
        ("reference", 40),
    ]
    for r in rows:
        assert r["saved_bytes"] == r["formula_bytes"] and r["peak_bytes"] is None


def test_rms_norm_and_swiglu_references_are_the_models_maths():
    cfg = get_preset("tiny")
    model = LlamaForCausalLM(cfg, seed=0)
    x = torch.randn(2, 5, cfg.hidden_size)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    torch.testing.assert_close(rms_norm_reference(x, norm.weight, norm.eps), norm(x), rtol=0, atol=0)
    g, u = torch.randn(3, 7), torch.randn(3, 7)
    torch.testing.assert_close(swiglu_reference(g, u), g * torch.sigmoid(g) * u)


def test_enable_validates_and_restores():
    with pytest.raises(ValueError, match="attention='flash2' must be one of"):
        K.enable(attention="flash2")
    assert K.settings() == K.KernelSettings()
    with K.use(attention="reference") as s:
        assert s.attention == "reference" and K.settings().attention == "reference"
        assert K.use_fused("attention", torch.zeros(1))
    assert K.settings().attention == "sdpa"
    assert not K.use_fused("attention", torch.zeros(1))
    with pytest.raises(ValueError, match="kind='norm'"):
        K.use_fused("norm", torch.zeros(1))
    assert K._from_env("attention=eager, rmsnorm, swiglu=0") == K.KernelSettings("eager", True, False)
    with pytest.raises(ValueError, match="LLMLAB_KERNELS item 'attention=xla'"):
        K._from_env("attention=xla")


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl", ["eager", "reference"])
def test_model_with_pytorch_attention_impls_matches_sdpa(impl):
    torch.manual_seed(0)
    model = LlamaForCausalLM(get_preset("tiny"), seed=0)
    ids = torch.randint(0, 256, (2, 21))
    loss0, grads0 = _loss_and_grads(model, ids)
    with K.use(attention=impl):
        loss1, grads1 = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_gpu_benchmarks_refuse_cpu():
    from llmlab.kernels.bench import bench_attention, bench_rmsnorm, bench_swiglu, peak_bandwidth

    for fn in (bench_attention, bench_rmsnorm, bench_swiglu):
        with pytest.raises(RuntimeError, match="no GPU"):
            fn()
    assert peak_bandwidth() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_switch_needs_package_and_falls_back_on_plain_cpu(monkeypatch):
    monkeypatch.setattr(K, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        K.enable(attention="triton")
    assert K.settings() == K.KernelSettings()
    # triton installed but neither CUDA nor the interpreter: CPU tensors keep PyTorch
    monkeypatch.setattr(K, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(2, 3)
    with pytest.warns(UserWarning, match="CPU tensors keep the PyTorch"):
        with K.use(attention="triton", rmsnorm=True, swiglu=True):
            assert not any(K.use_fused(kind, x) for kind in ("attention", "rmsnorm", "swiglu"))
            torch.testing.assert_close(K.swiglu(x + 1, x + 2), F.silu(x + 1) * (x + 2))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with K.use(attention="triton", rmsnorm=True):
        assert K.use_fused("attention", x) and K.use_fused("rmsnorm", x)
        assert not K.use_fused("swiglu", x)


def test_triton_platform_is_the_kernels_extras_marker():
    """The Triton tests skip exactly where the ``kernels`` extra installs no triton."""
    import re
    from pathlib import Path
    from llmlab.kernels import TRITON_MARKER

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    (req,) = re.findall(r'^kernels = \["triton[^;]*;(.*)"\]$', text, re.M)  # tomllib needs 3.11
    assert req.strip() == TRITON_MARKER
