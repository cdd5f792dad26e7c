"""The fp32 lm_head's greedy screen (llmlab.inference.greedy_screen): its bound holds against
fp64, its token is the full product's argmax (ties and near-ties included), rows it cannot settle
come back for the full product, and an engine's outputs are the same with and without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmlab.inference import LLM, SamplingParams
from llmlab.inference.greedy_screen import GreedyScreen, bound_constants
from llmlab.kernels import cpu_isa, cpu_fused, panel_linear
from llmlab.model.llama import LlamaForCausalLM
from tiny_llama import TINY

HAS_BF16 = "avx512_bf16" in cpu_isa.effective_flags()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="the screen multiplies in bf16 panels: AVX512-BF16")


def _data(rows: int, V: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 2, V)[torch.randperm(V, generator=g)]  # rows of many sizes
    w = torch.randn(V, K, generator=g) * scale[:, None] / K**0.5
    h = torch.randn(rows, K, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    return h, w


@needs_bf16
@pytest.mark.parametrize("shape", [(7, 1000, 64), (64, 4099, 96), (3, 129, 576)])
def test_the_bound_holds_against_fp64_and_the_token_is_the_argmax(shape):
    rows, V, K = shape
    h, w = _data(rows, V, K)
    s = GreedyScreen(w)
    approx = panel_linear.linear(h.bfloat16(), s.panels, V).float()
    exact = h.double() @ w.double().T
    c, u = bound_constants(K)
    bound = c * h.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1) + u * approx.double().abs()
    err = (approx.double() - exact).abs()
    assert (err <= bound).all()
    assert err.max() > 0.01 * bound.max()  # the data exercise it: not vacuous
    tokens, ok = s.argmax(h)
    assert all(ok)
    assert tokens == (h @ w.T).argmax(1).tolist() == exact.argmax(1).tolist()


@needs_bf16
def test_ties_take_the_first_maximum_and_near_ties_the_fp32_one():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(4, 64, generator=g), torch.randn(512, 64, generator=g)
    w[300] = w[20]  # an exact tie with the row's winner: the first index, as torch.argmax
    w[401] = w[77] * (1 + 2**-20)  # a near-tie that bf16 cannot see
    h[0] = w[20] * 50
    h[1] = w[77] * 50
    s = GreedyScreen(w)
    tokens, ok = s.argmax(h)
    assert all(ok)
    full = h @ w.T
    assert tokens == full.argmax(1).tolist()
    assert tokens[0] == 20 and full[0, 20] == full[0, 300]
    assert tokens[1] == 401 and full[1, 401] > full[1, 77]


@needs_bf16
def test_rows_that_are_not_finite_come_back_unsettled():
    h, w = _data(4, 300, 32, seed=2)
    h[1, 5] = float("nan")
    h[2, 0] = float("inf")
    s = GreedyScreen(w)
    tokens, ok = s.argmax(h)
    assert ok == [True, False, False, True]
    assert tokens[0] == int((h[0] @ w.T).argmax()) and tokens[3] == int((h[3] @ w.T).argmax())
    w[9] = float("inf")  # a weight row that overflows every product
    tokens, ok = GreedyScreen(w).argmax(h[[0]])
    assert ok == [False]


def test_the_kernel_names_its_constraints():
    if not HAS_BF16:
        pytest.skip("the kernel's own errors: the screen needs AVX512-BF16")
    h, w = torch.randn(2, 8), torch.randn(16, 8)
    with pytest.raises(RuntimeError, match="approx must be bf16"):
        cpu_fused.screened_argmax(h, torch.zeros(2, 16), w, w.norm(dim=1), 0.01, 0.004)
    with pytest.raises(RuntimeError, match=r"w must be a contiguous fp32 tensor \[V, 8\]"):
        cpu_fused.screened_argmax(
            h, torch.zeros(2, 16, dtype=torch.bfloat16), w[:, :4], w.norm(dim=1), 0.01, 0.004
        )


def test_the_screen_refuses_what_it_cannot_take(monkeypatch):
    with pytest.raises(ValueError, match="2-D fp32 CPU weight"):
        GreedyScreen(torch.randn(16, 8, dtype=torch.bfloat16))
    monkeypatch.setenv("LLMLAB_CPU_ISA", "avx512")  # below avx512_bf16: no bf16 panels
    assert not GreedyScreen.applies(torch.randn(16, 8))


def _engine(monkeypatch, screen: bool, **kw) -> LLM:
    cfg = dataclasses.replace(TINY, vocab_size=300)
    with monkeypatch.context() as m:
        if not screen:
            m.setattr(GreedyScreen, "applies", staticmethod(lambda w: False))
        return LLM(LlamaForCausalLM(cfg, seed=0), block_size=4, packed_linear=True, cpu_fused=True, **kw)


PROMPTS = [[(7 * i + j) % 300 for j in range(5 + 3 * i)] for i in range(5)]


@needs_bf16
def test_engine_outputs_equal_with_and_without_the_screen(monkeypatch):
    """Plain greedy rows take the screen; sampled, logprob and penalised rows of the same steps
    the full logits: every output is the same as the engine's without the screen."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=3),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
    ]
    calls = []
    on = _engine(monkeypatch, True)
    screen = on.engine.runner.greedy_screen
    assert screen is not None
    argmax = screen.argmax
    monkeypatch.setattr(screen, "argmax", lambda h: calls.append(h.shape[0]) or argmax(h))
    got = on.generate(PROMPTS, params)
    off = _engine(monkeypatch, False)
    assert off.engine.runner.greedy_screen is None
    ref = off.generate(PROMPTS, params)
    assert calls and max(calls) == 2  # the two plain-greedy rows, every step
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 10
    lp = [{t: e.logprob for t, e in step.items()} for step in got[2].outputs[0].logprobs]
    assert lp == [{t: e.logprob for t, e in step.items()} for step in ref[2].outputs[0].logprobs]


@needs_bf16
def test_engine_falls_back_when_the_level_is_lowered_after_start(monkeypatch):
    llm = _engine(monkeypatch, True)
    assert llm.engine.runner.greedy_screen is not None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    monkeypatch.setenv("LLMLAB_CPU_ISA", "avx512")  # the bf16 panels stop: full logits
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == ref


@needs_bf16
def test_engine_reports_a_non_finite_row_as_without_the_screen(monkeypatch):
    llm = _engine(monkeypatch, True)
    with torch.no_grad():
        llm.engine.runner.model.model.norm.weight[0] = float("nan")
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    for o in out:
        assert o.outputs[0].finish_reason == "error" and "non-finite logits (nan)" in (o.error or "")


def test_engine_without_bf16_panels_has_no_screen(monkeypatch):
    monkeypatch.setenv("LLMLAB_CPU_ISA", "avx2")
    llm = _engine(monkeypatch, True)
    assert llm.engine.runner.greedy_screen is None
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
