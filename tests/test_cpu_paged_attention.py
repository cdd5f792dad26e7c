"""The C++ PagedAttention for CPU tensors equals the PyTorch reference: on its own (prefill,
chunked prefill and decode rows in one call, so both of its paths: prompt rows from K transposed
into a buffer, decode and short-chunk rows read in place; GQA, sliding windows, several head dims,
fp32/bf16/fp16) and inside the engine (the same greedy tokens), and it refuses inputs that break
its constraints with an error naming them; the engine keeps the reference for head dims the kernel
is not compiled for.

The kernel is compiled on first use (about a minute here, then cached): it needs a C++ compiler and
ninja, which `pip install -e ".[dev]"` brings (the `cpu-kernels` extra); a missing one fails these
tests rather than skipping them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

import llmlab.kernels as K
from llmlab.inference import LLM, SamplingParams
from llmlab.inference.model_runner import ModelRunner
from llmlab.inference.paged_attention import (
    kernel_for,
    paged_attention,
    paged_attention_reference,
)
from cpu_levels import level_fixture
from llmlab.kernels import cpu_paged_attention as C
from llmlab.model.llama import LlamaForCausalLM
from tiny_llama import TINY

level = level_fixture(C)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _case(H, Hkv, D, ctx, qlens, dtype, block_size=8, num_blocks=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    width = max(-(-c // block_size) for c in ctx) + 1
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in ctx])
    q = torch.randn(sum(qlens), H, D, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(ctx), torch.tensor(qlens)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 4, 128), (6, 2, 48)])
@pytest.mark.parametrize("window", [None, 5])
def test_equals_the_reference_in_fp32(H, Hkv, D, window, level):
    # a whole prompt, a prompt chunk after a cached prefix, decodes, a one-token context
    args = _case(H, Hkv, D, ctx=[23, 40, 17, 1, 64], qlens=[23, 9, 1, 1, 1], dtype=torch.float32)
    got = C.paged_attention_cpu(*args, sliding_window=window)
    want = paged_attention_reference(*args, sliding_window=window)
    assert got.shape == want.shape == (35, H, D) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_within_its_rounding_of_the_fp32_reference(dtype, tol, level):
    q, k, v, t, c, ql = _case(9, 3, 64, ctx=[30, 12, 57], qlens=[30, 1, 4], dtype=dtype)
    got = C.paged_attention_cpu(q, k, v, t, c, ql)
    assert got.dtype == dtype
    want = paged_attention_reference(q.float(), k.float(), v.float(), t, c, ql)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 2, 128), (6, 2, 48), (2, 1, 32)])
@pytest.mark.parametrize("window", [None, 6, 7])
def test_bf16_paths_within_its_rounding(H, Hkv, D, window, level):
    # bf16 on AVX512-BF16 builds: dot products of bf16 pairs (head dims a multiple of 32; 48 takes
    # the widening path), K and V copied into key pairs for prompt rows (odd and even contexts:
    # a lone last key; windows that start on an odd key), V read in place for decode rows
    q, k, v, t, c, ql = _case(
        H,
        Hkv,
        D,
        ctx=[33, 40, 71, 1, 18, 100],
        qlens=[33, 9, 1, 1, 2, 100],
        dtype=torch.bfloat16,
        num_blocks=60,
    )
    got = C.paged_attention_cpu(q, k, v, t, c, ql, sliding_window=window)
    want = paged_attention_reference(q.float(), k.float(), v.float(), t, c, ql, sliding_window=window)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (8, 2, 16), (2, 2, 256), (10, 2, 80)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 21])
def test_prompt_row_tiles_within_rounding_of_the_reference(H, Hkv, D, dtype, tol, window, level):
    # prompt items take their (position, head) rows in tiles across positions (AVX-512: 24 / (D / 16)
    # rows, up to 12; fewer on AVX2), each row with its own last key and window start: G = 3, 4, 1,
    # 5 heads per kv head (tiles of two positions, three, one head, and tiles that split a
    # position), score steps of 16 to 64 keys with a narrowed last one, K transposed 16 keys at a
    # time (contexts of several steps, not multiples of 16), and a short chunk read in place
    args = _case(H, Hkv, D, ctx=[100, 77, 50], qlens=[100, 30, 3], dtype=dtype, num_blocks=60)
    got = C.paged_attention_cpu(*args, sliding_window=window)
    want = paged_attention_reference(
        *(a.float() if a.is_floating_point() else a for a in args), sliding_window=window
    )
    assert got.dtype == dtype and got.shape == (133, H, D)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (8, 1, 48), (4, 4, 128), (14, 2, 32)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_batches_within_rounding_of_the_reference(H, Hkv, D, dtype, tol, window, level):
    # a decode-only batch (one new token per sequence: whole-sequence items walking their blocks
    # with online softmax, also with one thread), G = 3, 8, 1, 7 query heads per kv head (row
    # tiles of up to 4), contexts of 1 key, a block's edge, several blocks and a partial block
    ctx = [1, 8, 9, 30, 64, 17]
    args = _case(H, Hkv, D, ctx=ctx, qlens=[1] * len(ctx), dtype=dtype, num_blocks=60)
    want = paged_attention_reference(
        *(a.float() if a.is_floating_point() else a for a in args), sliding_window=window
    )
    for threads in (1, torch.get_num_threads()):
        with torch_threads(threads):
            got = C.paged_attention_cpu(*args, sliding_window=window)
        assert got.dtype == dtype and got.shape == (len(ctx), H, D)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_strided_queries_and_a_scale():
    q, k, v, t, c, ql = _case(4, 2, 64, ctx=[10, 20], qlens=[10, 1], dtype=torch.float32)
    qk = torch.cat([q, torch.randn(11, 2, 64)], dim=1)  # q as the serving path hands it over
    got = C.paged_attention_cpu(qk[:, :4], k, v, t, c, ql, scale=0.3)
    torch.testing.assert_close(
        got, paged_attention_reference(q, k, v, t, c, ql, scale=0.3), atol=1e-5, rtol=1e-5
    )


def test_bad_inputs_name_the_constraint():
    q, k, v, t, c, ql = _case(4, 2, 64, ctx=[10, 20], qlens=[10, 1], dtype=torch.float32)
    with pytest.raises(RuntimeError, match="query_len <= context_len"):
        C.paged_attention_cpu(q, k, v, t, torch.tensor([5, 20]), ql)
    with pytest.raises(RuntimeError, match="query_lens sum to 11 but q has 12"):
        C.paged_attention_cpu(torch.randn(12, 4, 64), k, v, t, c, ql)
    with pytest.raises(RuntimeError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        C.paged_attention_cpu(q[:, :3], k, v, t, c, ql)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        C.paged_attention_cpu(q, k, v, t[:, :1], c, ql)
    with pytest.raises(RuntimeError, match="one dtype"):
        C.paged_attention_cpu(q, k.double(), v.double(), t, c, ql)


def test_dispatch_and_the_switch(monkeypatch):
    q, k = torch.zeros(1, 4, 64), torch.zeros(2, 8, 2, 64)
    with K.use(paged_attention="cpu"):
        assert kernel_for(q, k) == "cpu"
        args = _case(4, 2, 64, ctx=[9], qlens=[3], dtype=torch.float32)
        torch.testing.assert_close(
            paged_attention(*args), paged_attention_reference(*args), atol=1e-5, rtol=1e-5
        )
        assert kernel_for(torch.zeros(1, 4, 40), torch.zeros(2, 8, 2, 40)) == "reference"
    with pytest.raises(RuntimeError, match="head_dim=40 is not compiled"):
        C.paged_attention_cpu(*_case(4, 2, 40, ctx=[9], qlens=[3], dtype=torch.float32))
    with K.use(paged_attention="reference"):
        assert kernel_for(q, k) == "reference"
    assert K._from_env("paged_attention=cpu").paged_attention == "cpu"
    monkeypatch.setattr(C, "available", lambda: False)
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler and the ninja"):
        K.enable(paged_attention="cpu")


CFG = TINY


def test_engine_tokens_equal_the_reference_engine(level):
    """Prompts of several lengths, chunked prefill (a 16-token budget cuts the prompts) and
    prefix caching (two prompts share 12 tokens): in fp32 the kernel's greedy tokens are the
    reference's. (In bf16 the two round the attention output differently, and a random tiny
    model's near-ties then flip tokens; the kernel's bf16 error is bounded above.)"""
    model = LlamaForCausalLM(CFG, seed=0)
    shared = [(5 * j) % 97 for j in range(12)]
    prompts = [shared + [1, 2], shared + [3], [(7 * i + 3) % 97 for i in range(29)], [4]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(
        block_size=4,
        dtype=torch.float32,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    out = {}
    for impl in ("reference", "cpu"):
        with K.use(paged_attention=impl):
            llm = LLM(model, **kw)
            out[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            runner: ModelRunner = llm.engine.runner
            prompt, decode = SimpleNamespace(num_computed_tokens=0), SimpleNamespace(num_computed_tokens=5)
            one_call = len(runner.attention_groups([(prompt, 3), (decode, 1)])) == 1
            assert one_call == (impl == "cpu")  # the kernel takes prompts and decodes together
    assert out["cpu"] == out["reference"]
    assert all(len(t) == 12 for t in out["cpu"])
