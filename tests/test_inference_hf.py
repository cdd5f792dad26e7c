"""Greedy tokens of the engine equal Hugging Face ``generate(do_sample=False)`` on the same
checkpoint, for every request, whatever the batching, block size, preemption, chunking and prefix
caching (CONTRACT ``llmlab generate``). Tiny random checkpoints, fp64 on both sides so that argmax
ties cannot flip on rounding."""

from __future__ import annotations

import random

import pytest
import torch
import transformers  # a hard dependency: missing is a failure, not a skip

from llmlab.inference import LLM, SamplingParams
from llmlab.inference.hf_baseline import hf_greedy

MAX_TOKENS = 8
VOCAB = 128


def _make_checkpoint(path, kind: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        eos_token_id=3,
        bos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(path))
    return path


def _prompts(n: int = 64, seed: int = 0) -> list[list[int]]:
    """Ragged lengths 1..40 around block boundaries; half share a 20-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, VOCAB) for _ in range(20)]
    lengths = [1, 2, 15, 16, 17, 31, 33, 40]
    prompts = []
    for i in range(n):
        L = lengths[i % len(lengths)]
        body = [rng.randrange(4, VOCAB) for _ in range(L)]
        if i % 2 and L > 20:
            body = shared + body[20:]
        prompts.append(body)
    return prompts


def _hf_greedy(path, prompts) -> list[list[int]]:
    """HF generate (fp64), batched by prompt length (no padding needed), cut after the first EOS."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    return hf_greedy(model, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = _make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    prompts = _prompts()
    return path, prompts, _hf_greedy(path, prompts)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = _make_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")
    prompts = _prompts(seed=1)
    return path, prompts, _hf_greedy(path, prompts)


def _engine_tokens(path, prompts, **kw):
    llm = LLM(str(path), device="cpu", dtype=torch.float64, check_invariants=True, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # no leak
    return [o.outputs[0].token_ids for o in outs], eng


CONFIGS = {
    "bs16": dict(block_size=16),
    "bs1": dict(block_size=1),
    "preempt_recompute": dict(block_size=4, num_gpu_blocks=40),
    "preempt_swap": dict(block_size=4, num_gpu_blocks=40, preemption_mode="swap"),
    "chunked": dict(block_size=8, enable_chunked_prefill=True, max_num_batched_tokens=24),
    "prefix_cache": dict(block_size=4, enable_prefix_caching=True, max_num_batched_tokens=64),
    "prefix_chunked_preempt": dict(
        block_size=4,
        enable_prefix_caching=True,
        num_gpu_blocks=48,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
    ),
    "max_num_seqs_1": dict(block_size=16, max_num_seqs=1),
}


def test_one_request_matches_hf(llama):
    path, prompts, ref = llama
    got, _ = _engine_tokens(path, prompts[6:7])
    assert got == ref[6:7]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_64_requests_match_hf(llama, name):
    path, prompts, ref = llama
    small = name == "max_num_seqs_1" or name.startswith("preempt")
    n = 24 if small else len(prompts)  # slow configs: fewer requests
    got, eng = _engine_tokens(path, prompts[:n], **CONFIGS[name])
    assert got == ref[:n]
    steps = eng.step_metrics
    if name.startswith("preempt") or name == "prefix_chunked_preempt":
        assert sum(m.num_preemptions for m in steps) > 0
    if name == "preempt_swap":
        assert max(m.num_swapped for m in steps) > 0
    if name == "chunked":
        assert max(m.num_batched_tokens for m in steps) <= 24
    if name.startswith("prefix"):
        assert steps[-1].num_prefix_hit_tokens > 0
    if name == "max_num_seqs_1":
        assert max(m.num_seqs for m in steps) == 1
    else:
        assert max(m.num_seqs for m in steps) >= 5  # really batched


def test_qwen2_matches_hf(qwen2):
    path, prompts, ref = qwen2
    got, _ = _engine_tokens(
        path,
        prompts,
        block_size=4,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        num_gpu_blocks=60,
    )
    assert got == ref
