"""The engine's fast paths equal the reference they stand beside: the step-wide greedy argmax
(per-row sampling), the token-major serving rotary (apply_rotary), the per-step attention plan
(the reference recomputing it per call), the decoder layer's straight C++ calls (its
modules) and the C++ decode stack (the layers one by one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmlab.inference import LLM, SamplingParams
from llmlab.inference.batched_greedy import greedy_tokens
from llmlab.inference.attention_context import AttentionBatch, PagedAttentionContext
from llmlab.inference.paged_attention import paged_attention_reference
from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM, apply_rotary, rotary_cos_sin

CFG = ModelConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


class _Seq:
    def __init__(self, seq_id, **params):
        self.seq_id, self.num_output_tokens, self.pending_fork = seq_id, 0, 1
        self.params = SamplingParams(temperature=0.0, **params)


@pytest.mark.parametrize("cpu_fused", [False, True], ids=["torch", "c++"])
def test_greedy_tokens_equal_per_row_argmax_and_skip_what_is_not_plain(cpu_fused):
    torch.manual_seed(0)
    x = torch.randn(5, 49152)  # a real vocabulary's width (the vectorised reductions)
    x[1, 40000] = x[1, 3] = x[1].max() + 1  # a tie: the first maximum, like the per-row path
    x[2, 49151] = x[2, 17] = x[2].max() + 1
    x[4, 0] = float("nan")  # left to the per-row path (it reports the error)
    rows = dict(zip([10, 11, 12, 13, 14], x))
    seqs = [_Seq(10), _Seq(11), _Seq(12), _Seq(13, repetition_penalty=1.2), _Seq(14)]
    got = greedy_tokens(rows, seqs, cpu_fused)  # cpu_fused: the one-pass C++ argmax
    assert got == {i: int(torch.argmax(rows[i])) for i in (10, 11, 12)}
    assert got[11] == 3 and got[12] == 17
    banned = int(torch.argmax(rows[12]))  # a logit_bias row is processed per row
    seqs[2] = _Seq(12, logit_bias={banned: -100.0})
    assert 12 not in greedy_tokens(rows, seqs, cpu_fused)
    assert greedy_tokens({10: x[0]}, seqs[:1], cpu_fused) == {}  # one row: the per-row path


def test_engine_greedy_tokens_unchanged_by_the_fast_path(monkeypatch):
    model = LlamaForCausalLM(CFG, seed=0)
    prompts = [[(7 * i + j) % 97 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in LLM(model, block_size=4).generate(prompts, params)]
    import llmlab.inference.engine as E

    monkeypatch.setattr(E, "greedy_tokens", lambda logits, seqs, cpu_fused=False: {})  # the per-row reference
    ref = [o.outputs[0].token_ids for o in LLM(model, block_size=4).generate(prompts, params)]
    assert fast == ref and all(len(t) == 6 for t in fast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_straight_cpu_layers_equal_the_modules_bit_for_bit(monkeypatch, dtype):
    """With the C++ operators on, DecoderLayer._serve_cpu serves every layer (prompt, mixed and
    decode steps; packed and unpacked weights) with the logprobs of the modules' path exactly."""
    from llmlab.kernels import cpu_build
    from llmlab.model.llama import DecoderLayer

    if not cpu_build.available():
        pytest.skip("the C++ operators need a compiler and ninja")
    model = LlamaForCausalLM(CFG, seed=0).to(dtype)
    prompts = [[(7 * i + j) % 97 for j in range(5 + 3 * i)] for i in range(4)]  # (14 tokens at most)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=3)
    calls = []
    serve = DecoderLayer._serve_cpu
    monkeypatch.setattr(DecoderLayer, "_serve_cpu", lambda *a: calls.append(1) or serve(*a))

    def run(packed):
        llm = LLM(
            model, block_size=4, cpu_fused=True, packed_linear=packed, max_num_batched_tokens=16, dtype=dtype
        )
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    for packed in (False, True):
        calls.clear()
        straight = run(packed)
        assert len(calls) >= CFG.num_hidden_layers * 7  # every layer of every step
        monkeypatch.setattr(DecoderLayer, "_fused_serving", lambda self: False)
        calls.clear()
        modules = run(packed)
        assert calls == []
        monkeypatch.undo()
        monkeypatch.setattr(DecoderLayer, "_serve_cpu", lambda *a: calls.append(1) or serve(*a))
        assert straight == modules and all(len(t) == 7 for t, _ in straight)


# head_dim 16 (one the C++ attention is compiled for), biases, one sliding layer of two
STACK_CFG = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attention_bias=True,
    o_proj_bias=True,
    mlp_bias=True,
    sliding_window=5,
    sliding_window_layers=(1,),
)


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "biases+window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_stack_equals_the_layers_bit_for_bit(monkeypatch, dtype, bias):
    """The C++ decode stack (llmlab.kernels.cpu_decode_stack) takes the decode steps where every
    product runs on panels, and the engine's tokens and logprobs equal those of the layers run
    one by one (DecoderLayer._serve_cpu), exactly; without packed weights it never runs."""
    from llmlab.kernels import cpu_build, panel_linear

    if not cpu_build.available():
        pytest.skip("the C++ operators need a compiler and ninja")
    plain = dict(
        attention_bias=False, o_proj_bias=False, mlp_bias=False, sliding_window=None, sliding_window_layers=()
    )
    cfg = STACK_CFG if bias else dataclasses.replace(STACK_CFG, **plain)
    model = LlamaForCausalLM(cfg, seed=0).to(dtype)
    prompts = [[(7 * i + j) % 97 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=3)
    taken: list[bool] = []
    stack = LlamaForCausalLM._decode_stack

    def count_steps():  # records, per step, whether the stack took it
        monkeypatch.setattr(
            LlamaForCausalLM,
            "_decode_stack",
            lambda *a: (lambda r: taken.append(r is not None) or r)(stack(*a)),
        )

    count_steps()

    def run(packed):
        llm = LLM(
            model,
            block_size=4,
            cpu_fused=True,
            packed_linear=packed,
            paged_attention="cpu",
            max_num_batched_tokens=16,
            dtype=dtype,
        )
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    stacked = run(True)
    # every decode step: the four products have panels where this level builds the kernel
    assert (sum(taken) >= 6) == panel_linear.available(dtype) and not all(taken)
    monkeypatch.setattr(LlamaForCausalLM, "_decode_stack", lambda *a: None)
    assert run(True) == stacked and all(len(t) == 9 for t, _ in stacked)
    monkeypatch.undo()
    taken.clear()
    count_steps()
    run(False)
    assert taken and not any(taken)  # no packed weights, no panels: the layers one by one


def test_decode_stack_refuses_entry_points_of_another_kind():
    """The stack checks each capsule's name (the function and its signature) before calling it;
    with the right ones and no layers it returns x as it is."""
    from llmlab.kernels import cpu_build, cpu_decode_stack, cpu_fused, cpu_paged_attention, panel_linear

    if not cpu_build.available():
        pytest.skip("the C++ operators need a compiler and ninja")
    fused, panels = cpu_fused._module().entry_points(), panel_linear._module().entry_points()
    attention = cpu_paged_attention._module().entry_points()
    x, kv = torch.randn(1, 8), torch.zeros(1, 2, 1, 1, 1, 8)
    args = (x, x, x, kv, x, x, x, x, [], 1, 1, 8, 1.0)
    stack = cpu_decode_stack._module().decode_layers
    with pytest.raises(RuntimeError, match="expected the entry point llmlab.rms_norm"):
        stack(*args, panels + panels, panels, attention)
    with pytest.raises(RuntimeError, match="expected the entry point llmlab.paged_attention_cpu"):
        stack(*args, fused, panels, fused[:1])
    assert torch.equal(stack(*args, fused, panels, attention), x)


def test_serving_rotary_equals_apply_rotary_bitwise():
    """Attention._serve hands the context the q, k of apply_rotary in the training layout: bit
    for bit from unfused projections, to fp32 rounding from the fused one."""
    from llmlab.model.context import forward_context

    torch.manual_seed(0)
    N, D = 7, CFG.head_dim
    pos = torch.tensor([0, 5, 6, 1, 2, 3, 40])
    cos, sin = rotary_cos_sin(pos, D, 10000.0)
    x = torch.randn(1, N, CFG.hidden_size)

    class Capture:
        def attention(self, layer, q, k, v, window):
            self.q, self.k = q, k
            return torch.zeros_like(q)

    for fuse in (False, True):
        attn = LlamaForCausalLM(CFG, seed=0).model.layers[0].self_attn
        if fuse:
            attn.fuse()
        cap = Capture()
        with torch.no_grad(), forward_context(cap):
            attn(x, cos, sin)
        q = attn.q_proj(x).view(1, N, 4, D).transpose(1, 2)
        k = attn.k_proj(x).view(1, N, 2, D).transpose(1, 2)
        tol = dict(rtol=1e-6, atol=1e-6) if fuse else dict(rtol=0, atol=0)  # one matmul vs three
        torch.testing.assert_close(cap.q, apply_rotary(q, cos, sin)[0].transpose(0, 1), **tol)
        torch.testing.assert_close(cap.k, apply_rotary(k, cos, sin)[0].transpose(0, 1), **tol)


def test_context_reuses_its_plan_across_layers_and_windows():
    torch.manual_seed(0)
    bs, Hkv, D, L = 4, 2, 8, 3
    kv = torch.randn(L, 2, 16, bs, Hkv, D)
    tables = torch.tensor([[3, 9, 1], [4, 0, 0], [7, 2, 5]])
    ctx, ql = torch.tensor([10, 3, 12]), torch.tensor([4, 1, 2])
    N = int(ql.sum())
    slots = torch.tensor([1 * bs + 2, 1 * bs + 3, 9 * bs + 0, 9 * bs + 1, 4 * bs + 2, 5 * bs + 2, 5 * bs + 3])
    batch = AttentionBatch(
        torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.long), slots, tables, ctx, ql, True
    )
    c = PagedAttentionContext(kv.clone(), [batch])
    for layer, window in [(0, None), (1, 3), (2, None)]:
        q, k, v = torch.randn(N, 4, D), torch.randn(N, Hkv, D), torch.randn(N, Hkv, D)
        got = c.attention(layer, q, k, v, window)
        ref_cache = c.kv_cache[layer]  # written by the call above
        ref = paged_attention_reference(q, ref_cache[0], ref_cache[1], tables, ctx, ql, sliding_window=window)
        assert torch.equal(got, ref)
    assert set(c.plans) == {(0, None), (0, 3)}  # one plan per window, not per layer


def test_fresh_prompts_through_sdpa_equal_the_paged_kernel_in_a_mixed_step(monkeypatch):
    """A bf16 step of two whole prompts, a decode and a later prompt chunk: the prompts go to
    SDPA over the step's own K/V (llmlab.inference.prompt_sdpa), the rest to the C++ kernel, and
    the result is the reference's to bf16 rounding; fp32 steps and sliding windows keep the
    kernel alone, as do CPUs without AMX (forced here with LLMLAB_CPU_ISA=avx2)."""
    from llmlab.inference import prompt_sdpa

    torch.manual_seed(0)
    bs, H, Hkv, D = 4, 4, 2, 16
    ctx, ql = [20, 10, 17, 30], [20, 1, 17, 12]  # prompt, decode, prompt, chunk (18 cached)
    tables = torch.arange(4 * 8).view(4, 8)[:, torch.randperm(8)]
    slots = torch.tensor(
        [int(tables[s, p // bs]) * bs + p % bs for s in range(4) for p in range(ctx[s] - ql[s], ctx[s])]
    )
    N = sum(ql)
    amx = prompt_sdpa.takes(torch.bfloat16)
    for dtype, window, isa, sdpa in [
        (torch.bfloat16, None, None, amx),
        (torch.float32, None, None, False),
        (torch.bfloat16, 5, None, False),
        (torch.bfloat16, None, "avx2", False),
    ]:
        if isa:
            monkeypatch.setenv("LLMLAB_CPU_ISA", isa)
        kv = torch.randn(1, 2, 32, bs, Hkv, D, dtype=dtype)
        batch = AttentionBatch(
            torch.zeros(N, dtype=torch.long),
            torch.zeros(N, dtype=torch.long),
            slots,
            tables,
            torch.tensor(ctx),
            torch.tensor(ql),
            True,
        )
        c = PagedAttentionContext(kv.clone(), [batch], paged_attention="cpu")
        q, k, v = (torch.randn(N, h, D, dtype=dtype) for h in (H, Hkv, Hkv))
        got = c.attention(0, q, k, v, window)
        cache = c.kv_cache[0]
        ref = paged_attention_reference(
            q.float(),
            cache[0].float(),
            cache[1].float(),
            tables,
            torch.tensor(ctx),
            torch.tensor(ql),
            sliding_window=window,
        )
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.float(), ref, **tol)
        plan = c.prompt_plans[(0, window)]
        assert (plan is not None) == sdpa
        if sdpa:
            assert plan.prompts == [(0, 20), (21, 38)] and plan.rest_rows.tolist() == [20] + list(
                range(38, 50)
            )
