"""Log-probabilities at the engine (issue 37): each generated token's entry is made once, when it
is sampled (a request's cost stays linear in its length; the timing is in
``benchmarks/bench_logprobs.py``), and prompt logprobs come from the engine's own batched step:
no extra forward, also with chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import torch

from llmlab.inference import LLM, SamplingParams
from llmlab.inference import engine as engine_module


def _count(monkeypatch, obj, name: str) -> list[int]:
    calls = [0]
    real = getattr(obj, name)

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_each_generated_tokens_logprobs_are_made_once(monkeypatch):
    llm = LLM("shakespeare", block_size=8, num_gpu_blocks=256)
    tops = _count(monkeypatch, engine_module, "top_logprobs")
    decodes = _count(monkeypatch, llm.engine, "_decode_one")
    sp = SamplingParams(max_tokens=60, temperature=1.0, seed=0, ignore_eos=True, logprobs=3)
    outs = list(llm.stream(["ROMEO:"], sp))  # an output per step, as a server streams
    final = outs[-1].outputs[0]
    assert len(outs) == 60 and len(final.logprobs) == 60
    assert tops[0] == 60  # one per token, none rebuilt per step
    assert decodes[0] == sum(len(d) for d in final.logprobs) <= 60 * 4
    assert outs[10].outputs[0].logprobs[3] is final.logprobs[3]  # shared, not rebuilt
    assert len(outs[10].outputs[0].logprobs) == 11  # each output its own list


def _reference(llm, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = llm.engine.runner.model(torch.tensor(ids)[None])[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_prompt_logprobs_come_from_the_batched_step(monkeypatch):
    llm = LLM(
        "shakespeare",
        block_size=4,
        num_gpu_blocks=64,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    prompt = "ROMEO: But soft, what light through yonder window breaks?"
    ids = llm.engine.tokenizer.encode(prompt)
    want = _reference(llm, ids)
    forwards = _count(monkeypatch, llm.engine.runner, "forward")
    plain = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    n_plain = forwards[0]
    forwards[0] = 0
    for _ in range(2):  # the second time the prompt's blocks are in the prefix cache
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2))[0]
        assert forwards[0] == n_plain  # the same steps as without: no forward of its own
        forwards[0] = 0
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        got = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert all(
            len(d) <= 3 and sorted(v.rank for v in d.values())[:2] == [1, 2] for d in out.prompt_logprobs[1:]
        )
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        assert out.metrics.num_prefix_cached_tokens == 0  # it computed its whole prompt
    again = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    assert again.metrics.num_prefix_cached_tokens > 0  # while the cache does hold it
    many = llm.generate(
        [prompt, "KING:", prompt],
        [
            SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1),
            SamplingParams(max_tokens=3, temperature=0),
            SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0, n=2),
        ],
    )
    assert many[1].prompt_logprobs is None
    for o in (many[0], many[2]):
        got = torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], ids[1:])])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_prompt_logprobs_survive_recompute_preemption():
    """A cache too small for both requests: one is preempted and recomputes its prompt; its
    prompt logprobs are neither lost nor added twice."""
    llm = LLM("shakespeare", block_size=4, num_gpu_blocks=24, max_num_seqs=2, preemption_mode="recompute")
    prompts = ["ROMEO: But soft, what light", "JULIET: O Romeo, Romeo, wherefore"]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, [sp, sp])
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for p, o in zip(prompts, outs):
        ids = llm.engine.tokenizer.encode(p)
        got = torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], ids[1:])])
        assert len(o.prompt_logprobs) == len(ids)
        torch.testing.assert_close(got, _reference(llm, ids), atol=1e-4, rtol=0)
