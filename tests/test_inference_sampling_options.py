"""vLLM's sampling options against Hugging Face's logits processors and generate (issue 18):
repetition / presence / frequency penalties, min_tokens, min_p, logprobs, generation_config.json
defaults, per-request non-finite logits, exact admission. Tiny random checkpoints, fp64."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from llmlab.inference import LLM, SamplingParams
from llmlab.inference.sampling import apply_min_p, apply_min_tokens, apply_penalties, process_logits
from llmlab.model.config import get_preset

VOCAB = 96


def _llama(path, generation: dict | None = None, **over):
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        eos_token_id=None,
        bos_token_id=1,
        pad_token_id=0,
    )
    cfg.update(over)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    model.save_pretrained(str(path))
    gen = path / "generation_config.json"
    if gen.exists():
        gen.unlink()
    if generation is not None:
        gen.write_text(json.dumps(generation))
    return path


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()


def _hf_greedy(hf, prompt, n, **kw):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0, **kw
        )
    return out[0, len(prompt) :].tolist()


PROMPTS = [[5, 9, 9, 14, 5, 30, 2], [40, 41], [7] * 12 + [8, 9]]


# --- processors, one by one, against HF's ------------------------------------------------------
def test_processors_give_hf_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=g) * 3
    prompt, out = [3, 5, 5, 7], [5, 11, 11, 11, 2]
    ids = torch.tensor([prompt + out])
    for rp in (0.7, 1.3):
        want = transformers.RepetitionPenaltyLogitsProcessor(rp)(ids, logits[None].clone())[0]
        got = apply_penalties(logits, prompt, out, repetition_penalty=rp)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for mp in (0.05, 0.3):
        want = transformers.MinPLogitsWarper(mp)(ids, logits[None].clone())[0]
        assert torch.equal(apply_min_p(logits, mp).isinf(), want.isinf())
        assert 0 < int(want.isfinite().sum()) < VOCAB
    proc = transformers.MinNewTokensLengthLogitsProcessor(len(prompt), 8, eos_token_id=[2, 11])
    want = proc(ids, logits[None].clone())[0]  # 5 of 8 new tokens so far
    assert torch.equal(apply_min_tokens(logits, len(out), 8, [2, 11]), want)
    assert torch.equal(apply_min_tokens(logits, 8, 8, [2, 11]), logits)
    # presence / frequency (OpenAI's definition; HF has no processor): output counts only
    got = apply_penalties(logits, prompt, out, presence_penalty=0.5, frequency_penalty=0.25)
    counts = torch.zeros(VOCAB)
    for t in out:
        counts[t] += 1
    torch.testing.assert_close(got, logits - 0.25 * counts - 0.5 * (counts > 0).float())
    assert got[3] == logits[3]  # a prompt-only token: untouched
    # vLLM's order: min_tokens mask, then penalties
    sp = SamplingParams(min_tokens=9, repetition_penalty=1.3, frequency_penalty=1.0)
    got = process_logits(logits, sp, prompt, out, [2])
    assert got[2] == float("-inf")
    torch.testing.assert_close(got[11], logits[11] / 1.3 - 3.0 if logits[11] > 0 else logits[11] * 1.3 - 3.0)


def test_unset_fields_take_the_checkpoint_generation_config(tmp_path):
    """A checkpoint whose generation_config.json sets repetition_penalty: temperature 0 gives HF's
    greedy generate (which applies it too); an explicit value wins; the defaults used are reported."""
    path = _llama(
        tmp_path / "m", generation={"repetition_penalty": 1.8, "max_new_tokens": 9, "bos_token_id": 1}
    )
    hf = _hf(path)
    llm = LLM(str(path), device="cpu", dtype=torch.float64, block_size=4, check_invariants=True)
    assert llm.engine.generation_defaults == {"repetition_penalty": 1.8, "max_tokens": 9}
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0))
    want = [_hf_greedy(hf, p, 9) for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[0].sampling_defaults == {"repetition_penalty": 1.8, "max_tokens": 9}
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, repetition_penalty=1.0, max_tokens=9))
    assert [o.outputs[0].token_ids for o in plain] == [
        _hf_greedy(hf, p, 9, repetition_penalty=1.0) for p in PROMPTS
    ]
    assert [o.outputs[0].token_ids for o in plain] != want  # the penalty changed something
    assert plain[0].sampling_defaults == {}
    sp = SamplingParams(temperature=0)
    assert not sp.is_set("repetition_penalty") and sp.is_set("temperature")


def test_min_tokens_and_logprobs_match_hf(tmp_path):
    path = _llama(tmp_path / "m")
    hf = _hf(path)
    free = _hf_greedy(hf, PROMPTS[0], 6)
    eos = free[1]  # the model would stop at token 2
    llm = LLM(str(path), device="cpu", dtype=torch.float64, block_size=4, check_invariants=True)
    llm.engine.eos_token_ids = [eos]
    short = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert short.token_ids == free[:2] and short.finish_reason == "stop"
    got = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, min_tokens=4, logprobs=3))[
        0
    ].outputs[0]
    want = _hf_greedy(hf, PROMPTS[0], 6, min_new_tokens=4, eos_token_id=eos)
    want = want[: want.index(eos) + 1] if eos in want[4:] else want
    assert got.token_ids == want and eos not in got.token_ids[:4]
    # logprobs: the raw log-softmax of the model's logits at each position (before min_tokens)
    with torch.no_grad():
        full = torch.tensor([PROMPTS[0] + got.token_ids])
        lp = torch.log_softmax(hf(full).logits[0, len(PROMPTS[0]) - 1 : -1].float(), -1)
    for k, (t, d) in enumerate(zip(got.token_ids, got.logprobs)):
        top = torch.topk(lp[k], 3)
        assert set(d) == set(top.indices.tolist()) | {t}
        assert d[t].logprob == pytest.approx(float(lp[k, t]), abs=1e-5)
        assert d[int(top.indices[0])].rank == 1
    assert got.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for t, d in zip(got.token_ids, got.logprobs))
    )


def test_non_finite_logits_fail_only_their_request():
    cfg = get_preset("tiny", num_hidden_layers=2, initializer_range=0.2)
    prompts = ["ROMEO:", "JULIET:", "MAC"]
    sp = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(cfg, device="cpu", block_size=4, check_invariants=True)
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    eng = llm.engine
    run = eng.runner.execute
    calls = []

    def poisoned(out):
        logits = run(out)
        calls.append(1)
        if len(calls) == 3:  # the third step: poison request 1
            for seq, _ in out.scheduled:
                if seq.request_id == eng_ids[1] and seq.seq_id in logits:
                    logits[seq.seq_id] = logits[seq.seq_id].clone()
                    logits[seq.seq_id][5] = float("nan")
        return logits

    eng.runner.execute = poisoned
    eng_ids = [eng.add_request(p, sp) for p in prompts]
    while eng.has_unfinished_requests():
        eng.step()
    outs = [eng.get_output(r) for r in eng_ids]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert "non-finite logits (nan)" in outs[1].error and outs[1].finished
    assert outs[1].outputs[0].token_ids == clean[1][:2]
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [clean[0], clean[2]]
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    eng.runner.execute = run  # the engine stays usable
    assert llm.generate(prompts[1], sp)[0].outputs[0].token_ids == clean[1]


def test_a_request_that_fits_exactly_is_admitted():
    """The last sampled token never gets K/V: prompt 4 + 5 new tokens store 8 tokens = 2 blocks."""
    cfg = get_preset("tiny", num_hidden_layers=2, initializer_range=0.2)
    llm = LLM(cfg, device="cpu", block_size=4, num_gpu_blocks=2, check_invariants=True)
    out = llm.generate("ABCD", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    over = llm.generate("ABCD", SamplingParams(temperature=0, max_tokens=6))[0]
    assert over.outputs[0].finish_reason == "error" and "needs 3 KV blocks" in over.error
    # context-capped: max_model_len 9 stores at most 8 tokens whatever max_tokens says
    llm = LLM(cfg, device="cpu", block_size=4, num_gpu_blocks=2, max_model_len=9)
    out = llm.generate("ABCD", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5


def test_seeded_sampling_with_every_option_is_batch_independent():
    cfg = get_preset("tiny", num_hidden_layers=2, initializer_range=0.2)
    sp = SamplingParams(
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        min_p=0.02,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        min_tokens=3,
        seed=7,
        max_tokens=10,
        logprobs=2,
    )
    llm = LLM(cfg, device="cpu", dtype=torch.float64, block_size=4, check_invariants=True)
    alone = llm.generate("ROMEO:", sp)[0].outputs[0]
    both = llm.generate(["JULIET: hi", "ROMEO:"], [SamplingParams(seed=1, max_tokens=12), sp])
    assert both[1].outputs[0].token_ids == alone.token_ids and len(alone.logprobs) == 10


def test_stop_matcher_finds_what_str_find_finds_and_holds_the_right_tail():
    """The KMP matcher fed piece by piece equals a search of the whole text, and its held tail is
    the longest stop-string prefix the text ends with."""
    import random

    from llmlab.inference.stop_checker import StopMatcher

    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(3)]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        m, pos, got = StopMatcher(stops), 0, None
        while pos < len(text) and got is None:
            end = min(len(text), pos + rng.randint(1, 4))
            got = m.feed(text[:end], pos)
            pos = end
        hits = [(i, s) for s in stops if (i := text[:pos].find(s)) >= 0]
        assert got == (min(hits) if hits else None), (stops, text)
        if got is None:
            want = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            assert m.held == want, (stops, text)
