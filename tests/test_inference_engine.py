"""Engine behaviour: sampling, stops, n > 1 with copy-on-write, streaming, errors, metrics, the
shipped default model and ``llmlab generate``. The pool is checked after every step
(``check_invariants``) and must be full again at the end of every test."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmlab.data import ByteTokenizer, load_corpus
from llmlab.inference import LLM, SamplingParams
from llmlab.inference.loader import shipped_model_dir
from llmlab.inference.sampling import filter_logits
from llmlab.model.config import get_preset

CFG = get_preset("tiny", num_hidden_layers=2, initializer_range=0.2)


def make_llm(**kw):
    kw.setdefault("block_size", 4)
    return LLM(CFG, device="cpu", check_invariants=True, **kw)


def assert_pool_full(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.host_free) == bm.num_host_blocks


def naive_greedy(model, ids, n):
    ids = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0].tolist()


def test_greedy_equals_no_cache_oracle_and_top_k1_top_p_tiny_are_greedy():
    llm = make_llm()
    prompts = ["ROMEO:", "a", "JULIET: O Romeo"]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    model = llm.engine.runner.model
    for p, o in zip(prompts, greedy):
        ids = ByteTokenizer().encode(p)
        assert ids + o.outputs[0].token_ids == naive_greedy(model, ids, 6)
    for sp in (
        SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=6),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=3, max_tokens=6),
    ):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == [
            o.outputs[0].token_ids for o in greedy
        ]
    assert_pool_full(llm)


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.81)).tolist() == [True, True, True, False]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    sp = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7, max_tokens=10)
    alone = make_llm().generate(["ROMEO:"], sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=5 + i) for i in range(6)]
    llm = make_llm(num_gpu_blocks=12)  # small: forces preemptions
    outs = llm.generate(
        ["x" * 9, "ROMEO:", "yy", "To be", "Macbeth", "z" * 13, "MAC"], [others[0], sp] + others[1:]
    )
    assert outs[1].outputs[0].token_ids == alone
    assert sum(m.num_preemptions for m in llm.engine.step_metrics) > 0
    unseeded = make_llm().generate(["ROMEO:"] * 2, SamplingParams(temperature=1.0, max_tokens=10))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids
    assert_pool_full(llm)


def test_n_samples_share_the_prompt_and_copy_on_write():
    llm = make_llm()
    out = llm.generate("ROMEO:", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))[0]
    toks = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(t) == 8 for t in toks)
    assert len({tuple(t) for t in toks}) == 3
    assert sum(m.num_cow_copies for m in llm.engine.step_metrics) == 2  # 6 % 4 != 0: 2 copies
    assert out.finished
    assert_pool_full(llm)


def test_bad_requests_fail_alone_clearly_and_leak_nothing():
    llm = make_llm(num_gpu_blocks=8, max_model_len=64)
    eng = llm.engine
    for prompt, params, msg in [
        ("", SamplingParams(), "empty prompt"),
        ("x" * 65, SamplingParams(), "max_model_len=64"),
        ("x" * 40, SamplingParams(max_tokens=1), "whole cache"),  # 10 blocks
        ([300], SamplingParams(), "vocab_size=256"),
        ("ok", SamplingParams(stop_token_ids=[999]), "stop_token_ids"),
    ]:
        with pytest.raises(ValueError, match=msg):  # the engine API refuses it
            eng.add_request(prompt, params)
        # LLM.generate: that request fails alone, the good ones around it are served
        outs = llm.generate(
            ["ROMEO:", prompt, "MAC"],
            [
                SamplingParams(temperature=0, max_tokens=3),
                params,
                SamplingParams(temperature=0, max_tokens=3),
            ],
        )
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
        assert outs[1].finished and msg in outs[1].error and outs[1].outputs[0].token_ids == []
        assert outs[0].error is None and len(outs[2].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_model_len=4096"):
        LLM(CFG, device="cpu", max_model_len=4096)  # the model has 256 positions
    assert_pool_full(llm)
    assert not llm.engine.has_unfinished_requests()


def test_streaming_and_abort_and_metrics():
    llm = make_llm()
    sp = SamplingParams(temperature=0, max_tokens=6)
    final = llm.generate(["ROMEO:", "MAC"], sp)
    seen = {}
    for o in llm.stream(["ROMEO:", "MAC"], sp):
        prev = seen.get(o.prompt, [])
        assert o.outputs[0].token_ids[: len(prev)] == prev and len(o.outputs[0].token_ids) == len(prev) + 1
        seen[o.prompt] = o.outputs[0].token_ids
    assert [seen["ROMEO:"], seen["MAC"]] == [o.outputs[0].token_ids for o in final]
    gen = llm.stream(["ROMEO:"], SamplingParams(max_tokens=50))
    next(gen)
    assert llm.engine.block_manager.num_used_blocks > 0
    gen.close()  # client goes away: request aborted
    assert_pool_full(llm)
    assert not llm.engine.has_unfinished_requests()
    m = final[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert m.ttft > 0 and m.tpot > 0 and m.num_output_tokens == 6
    steps = llm.engine.step_metrics
    assert steps[0].num_seqs == 2 and steps[0].num_prefill_tokens == 9
    assert all(0.0 <= s.kv_waste_fraction < 1.0 for s in steps if s.kv_blocks_used)
    assert_pool_full(llm)


# --- the shipped model and the CLI -----------------------------------------------------------------
def test_shipped_default_model_has_learned_the_corpus():
    assert shipped_model_dir("shakespeare") is not None
    llm = LLM(device="cpu")  # default: the shipped model
    model = llm.engine.runner.model
    text = load_corpus()[10000 : 10000 + 256]
    ids = torch.tensor([ByteTokenizer().encode(text)])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:]).item()
    assert loss < 2.3 < math.log(256)  # nats/byte; uniform 5.55, byte unigram of English ~2.9
    out = llm.generate("ROMEO:", SamplingParams(temperature=0.8, seed=0, max_tokens=64))[0]
    words = out.outputs[0].text.split()
    assert len(words) >= 5 and all(c.isprintable() or c.isspace() for c in out.outputs[0].text)


def test_max_tokens_one_stop_strings_and_stop_token_ids():
    llm = LLM(device="cpu", block_size=4, check_invariants=True)  # shipped model: ASCII text
    ref = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert ref.text == bytes(ref.token_ids).decode()
    one = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
    assert one.token_ids == ref.token_ids[:1] and one.finish_reason == "length"
    stop = ref.text[10:13]  # three bytes: split across three tokens
    first = ref.text.find(stop)
    got = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert got.finish_reason == "stop" and got.text == ref.text[:first]
    assert got.token_ids == ref.token_ids[: first + 3]
    tok = ref.token_ids[5]
    k = ref.token_ids.index(tok)
    got = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok]))[
        0
    ].outputs[0]
    assert got.finish_reason == "stop" and got.token_ids == ref.token_ids[: k + 1]
    assert got.text == ref.text[:k]
    kept = llm.generate(
        "ROMEO:",
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.token_ids == got.token_ids and kept.text == ref.text[: k + 1]  # the token's text too
    late = llm.generate(
        "ROMEO:", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok], min_tokens=k + 1)
    )[0].outputs[0]
    # the stop token is masked for the first k + 1 tokens: the same up to k, another token at k,
    # then the first stop token after min_tokens ends it
    assert late.token_ids[:k] == ref.token_ids[:k] and tok not in late.token_ids[: k + 1]
    assert late.finish_reason == "length" or (
        late.token_ids[-1] == tok and late.finish_reason == "stop" and late.token_ids.count(tok) == 1
    )
    assert_pool_full(llm)


def test_cli_generate_prompt_and_jsonl(tmp_path, capsys):
    from llmlab.cli import main

    assert main(["generate", "--prompt", "ROMEO:", "--max-tokens", "16", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"prompt": "JULIET:", "max_tokens": 3})
        + "\n"
        + json.dumps({"prompt_token_ids": [65, 66], "temperature": 0, "stop": ["\n"]})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                "--prompts-file",
                str(src),
                "--output",
                str(out),
                "--max-tokens",
                "5",
                "--block-size",
                "4",
                "--enable-prefix-caching",
                "--enable-chunked-prefill",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    assert rows[0]["prompt_token_ids"] == list(b"JULIET:") and len(rows[0]["token_ids"]) == 3
    assert rows[1]["prompt_token_ids"] == [65, 66] and rows[1]["finish_reason"] in ("stop", "length")
    assert set(rows[1]) == {
        "index",
        "prompt_token_ids",
        "token_ids",
        "text",
        "finish_reason",
        "error",
        "sampling_defaults",
    }
    assert rows[1]["error"] is None and rows[1]["sampling_defaults"] == {}
    assert main(["generate", "--prompt", "", "--device", "cpu"]) == 2  # clear error, no hang
    assert "empty prompt" in capsys.readouterr().err
    # a prompts file with bad requests among good ones: results for the good, error lines, exit 2
    src.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "A", "max_tokens": 2}),
                json.dumps({"prompt": ""}),
                "{not json",
                json.dumps({"prompt": "B", "top_p": 0}),
                json.dumps({"prompt": "C", "max_tokens": 2, "logprobs": 2}),
            ]
        )
        + "\n"
    )
    assert main(["generate", "--prompts-file", str(src), "--output", str(out), "--temperature", "0"]) == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["finish_reason"] for r in rows] == ["length", "error", "error", "error", "length"]
    assert "empty prompt" in rows[1]["error"] and ":3: not valid JSON" in rows[2]["error"]
    assert "top_p" in rows[3]["error"] and rows[0]["error"] is None and len(rows[4]["token_ids"]) == 2
    lp = rows[4]["logprobs"]
    assert len(lp) == 2 and all(d[0]["rank"] == 1 and len(d) == 2 for d in lp)  # greedy: rank 1
    # values of the wrong JSON type: an error line naming the field, never a crash of the batch
    src.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": 5},
                {"prompt_token_ids": "ab"},
                {"prompt": "A", "temperature": "hot"},
                {"prompt": "A", "max_tokens": 2.5},
                {"prompt": "A", "stop": 7},
                {"prompt": "A", "max_tokens": 2, "top_p": 1, "seed": None},
            ]
        )
        + "\n"
    )
    assert main(["generate", "--prompts-file", str(src), "--output", str(out), "--temperature", "0"]) == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    errors = [r["error"] for r in rows]
    assert ":1: 'prompt' must be a string" in errors[0]
    assert ":2: 'prompt_token_ids' must be a list of integers" in errors[1]
    assert errors[2:5] == [
        "temperature must be float, got 'hot'",
        "max_tokens must be int, got 2.5",
        "stop must be str or list of str, got 7",
    ]
    assert errors[5] is None and len(rows[5]["token_ids"]) == 2


def test_swap_space_defaults_to_4_gib_not_the_whole_device_cache():
    """The host mirror for swap preemption is pinned memory on CUDA: mirroring a 40 GB device
    cache pinned 40 GB of host RAM. Default: 4 GiB of blocks (vLLM's swap_space), at most the
    device blocks."""
    from llmlab.inference.engine import LLMEngine, default_host_blocks
    from llmlab.inference.model_runner import kv_bytes_per_block

    per_block = 2 * 2**20
    assert default_host_blocks(20_000, per_block) == 2048  # 4 GiB, not 20,000 blocks
    assert default_host_blocks(100, per_block) == 100  # a small cache: mirrored
    assert default_host_blocks(100, per_block, swap_space_bytes=0) == 0
    with pytest.raises(ValueError, match="swap_space_bytes=-1"):
        default_host_blocks(1, per_block, swap_space_bytes=-1)
    eng = LLMEngine(preemption_mode="swap", num_gpu_blocks=64, block_size=4)
    assert eng.block_manager.num_host_blocks == 64
    b = kv_bytes_per_block(eng.model_config, 4, torch.float32)
    eng = LLMEngine(preemption_mode="swap", num_gpu_blocks=64, block_size=4, swap_space_bytes=10 * b)
    assert eng.block_manager.num_host_blocks == 10 and eng.runner.host_cache.shape[2] == 10


def test_cli_generate_accepts_every_contract_request_field(tmp_path):
    """CONTRACT.md: prompts-file lines may carry n, temperature, top_k, top_p, seed, max_tokens,
    min_tokens, stop, stop_token_ids, ignore_eos, the three penalties, min_p and logprobs."""
    from llmlab.cli import main

    fields = {
        "n": 2,
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.9,
        "seed": 3,
        "max_tokens": 3,
        "min_tokens": 1,
        "stop": ["\n\n\n"],
        "stop_token_ids": [0],
        "ignore_eos": True,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "min_p": 0.01,
        "logprobs": 1,
    }
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        json.dumps({"prompt": "ROMEO:", **fields})
        + "\n"
        + json.dumps({"prompt_token_ids": [72, 101], "max_tokens": 2})
        + "\n"
    )
    assert main(["generate", "--prompts-file", str(src), "--output", str(out), "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and [r["error"] for r in rows] == [None, None]
    assert len(rows[0]["outputs"]) == 2 and "outputs" not in rows[1]  # n = 2 samples
    assert rows[0]["token_ids"] == rows[0]["outputs"][0]["token_ids"]
    assert all(len(s["token_ids"]) == 3 and s["finish_reason"] == "length" for s in rows[0]["outputs"])
    assert rows[1]["prompt_token_ids"] == [72, 101] and len(rows[1]["token_ids"]) == 2


def test_engine_takes_an_engine_config_or_its_fields():
    from llmlab.inference import EngineConfig, LLMEngine

    cfg = EngineConfig(block_size=8, num_gpu_blocks=40, max_num_seqs=4, max_n=2)
    a, b = (
        LLMEngine("shakespeare", config=cfg),
        LLMEngine("shakespeare", block_size=8, num_gpu_blocks=40, max_num_seqs=4, max_n=2),
    )
    assert a.config == b.config == cfg and a.num_gpu_blocks == 40 and a.block_size == 8
    assert LLMEngine("shakespeare", config=cfg, block_size=4).block_size == 4  # keywords win
    with pytest.raises(ValueError, match="n: 3 is over the limit max_n=2"):
        a.add_request("ROMEO:", SamplingParams(n=3))
    with pytest.raises(ValueError, match="block_size=0"):
        EngineConfig(block_size=0).validate()
    with pytest.raises(TypeError):
        LLMEngine("shakespeare", blok_size=8)
