"""Seeded random engine configurations (issue 18): block size, chunked prefill, prefix caching,
preemption mode, cache size, n, sampling options, arrivals and aborts drawn at random. Every
request's samples must equal what it produces alone in a fresh engine (seeded sampling is
batch-independent), an aborted request's tokens must be a prefix of those, and the block pool is
checked after every step (``check_invariants``) and full at the end. fp64, a one-layer model."""

from __future__ import annotations

import random

import pytest
import torch

from llmlab.inference import LLMEngine, SamplingParams
from llmlab.model.config import get_preset

CFG = get_preset(
    "tiny",
    num_hidden_layers=1,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.3,
)


def _params(rng: random.Random) -> SamplingParams:
    kw = dict(
        n=rng.choice([1, 1, 2, 3]), seed=rng.randrange(1000), max_tokens=rng.randint(1, 10), ignore_eos=True
    )
    if rng.random() < 0.3:
        kw["temperature"] = 0.0
    else:
        kw.update(
            temperature=rng.choice([0.7, 1.0, 1.3]),
            top_k=rng.choice([0, 5, 50]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]),
        )
    if rng.random() < 0.5:
        kw.update(
            repetition_penalty=rng.choice([0.8, 1.3]),
            presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, -0.5]),
        )
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        kw["stop_token_ids"] = [rng.randrange(256)]
    return SamplingParams(**kw)


def _engine(**kw):
    return LLMEngine(CFG, device="cpu", dtype=torch.float64, check_invariants=True, **kw)


def _tokens(out):
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("seed", range(4))
def test_random_configuration_batched_equals_alone(seed):
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(12)]
    reqs = []
    for i in range(rng.randint(5, 8)):
        body = [rng.randrange(256) for _ in range(rng.randint(1, 20))]
        prompt = shared[: rng.randint(4, 12)] + body if rng.random() < 0.5 else body
        reqs.append(
            dict(
                prompt=prompt,
                params=_params(rng),
                arrive=rng.randint(0, 6),
                abort=rng.randint(1, 8) if rng.random() < 0.2 else None,
            )
        )
    block_size = rng.choice([1, 2, 4, 8])
    longest = max(len(r["prompt"]) + r["params"].max_tokens for r in reqs)
    chunked = rng.random() < 0.5
    kw = dict(
        block_size=block_size,
        enable_prefix_caching=rng.random() < 0.5,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=rng.choice([8, 16]) if chunked else 64,
        preemption_mode=rng.choice(["recompute", "swap"]),
        num_gpu_blocks=-(-longest // block_size) + rng.randint(0, 8),
        max_num_seqs=rng.choice([3, 8, 256]),
    )
    eng = _engine(**kw)
    ids, step = {}, 0
    while step < 7 or eng.has_unfinished_requests():
        for i, r in enumerate(reqs):
            if r["arrive"] == step:
                ids[i] = eng.add_request(r["prompt"], r["params"])
            if r["abort"] is not None and r["arrive"] + r["abort"] == step and i in ids:
                eng.abort_request(ids[i])
        eng.step()
        step += 1
        assert step < 500, "no progress"
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.host_free) == bm.num_host_blocks
    preempted = sum(m.num_preemptions for m in eng.step_metrics)
    for i, r in enumerate(reqs):
        got = eng.get_output(ids[i])
        alone = _engine(block_size=16)
        rid = alone.add_request(r["prompt"], r["params"])
        while alone.has_unfinished_requests():
            alone.step()
        want = _tokens(alone.get_output(rid))
        if got.outputs[0].finish_reason == "abort" or any(c.finish_reason == "abort" for c in got.outputs):
            assert all(w[: len(g)] == g for g, w in zip(_tokens(got), want)), (seed, i, kw)
        else:
            assert _tokens(got) == want, (seed, i, kw, preempted)
