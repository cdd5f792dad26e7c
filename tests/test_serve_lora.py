"""Serving LoRA adapters beside the base (issue 42): per-row adapter selection in one step, greedy
tokens equal to transformers + peft on the merged model, adapters loaded and unloaded at run time."""

import pytest
import torch
from hf_tiny import tiny_checkpoint

from llmlab.inference.engine import LLMEngine
from llmlab.inference.sampling import SamplingParams
from llmlab.model.hf import load_hf_model
from llmlab.model.lora import apply_lora, lora_state, save_peft_adapter

N = 8
PROMPTS = ["Romeo, Romeo", "What light", "Romeo, Romeo"]


def _adapter(base: str, path, seed: int, targets=("q_proj", "v_proj", "down_proj")):
    """A PEFT adapter for ``base`` with random, non-zero A and B."""
    model = load_hf_model(base)
    apply_lora(model, list(targets), 4, 8.0, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_state(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return save_peft_adapter(lora_state(model), path, base=base, rank=4, alpha=8.0, targets=list(targets))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = str(tiny_checkpoint(d / "llama", initializer_range=0.2))  # peaked logits: no near-ties
    return base, _adapter(base, d / "a", 1), _adapter(base, d / "b", 2, ("k_proj", "o_proj", "up_proj"))


def _hf_greedy(base: str, adapter=None) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        m = PeftModel.from_pretrained(m, str(adapter)).merge_and_unload()
    out = []
    for p in PROMPTS:
        x = tok(p, return_tensors="pt").input_ids
        out.append(
            m.generate(x, do_sample=False, max_new_tokens=N, min_new_tokens=N, pad_token_id=tok.pad_token_id)[
                0, x.shape[1] :
            ].tolist()
        )
    return out


def _run(engine, loras) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    ids = [engine.add_request(p, sp, lora=name) for p, name in zip(PROMPTS, loras)]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.get_output(i).outputs[0].token_ids for i in ids]


def test_mixed_adapter_batches_give_the_merged_models_greedy_tokens(setup):
    base, a, b = setup
    engine = LLMEngine(base)
    engine.enable_lora(max_loras=2, max_lora_rank=8)
    engine.add_lora("a", a)
    want_base, want_a = _hf_greedy(base), _hf_greedy(base, a)
    assert want_a[0] != want_base[0]  # the adapter changes the answer
    got = _run(engine, ["a", None, None])  # one step: adapter and base rows together
    assert got == [want_a[0], want_base[1], want_base[2]]
    # loaded at run time: the next request runs with it; unloading frees its slot
    engine.add_lora("b", b)
    assert sorted(engine.lora_adapters()) == ["a", "b"]
    got = _run(engine, ["b", "a", None])
    assert got == [_hf_greedy(base, b)[0], want_a[1], want_base[2]]
    with pytest.raises(ValueError, match="--max-loras 2 adapters are loaded already"):
        engine.add_lora("c", a)
    engine.remove_lora("a")
    assert list(engine.lora_adapters()) == ["b"]
    with pytest.raises(KeyError):
        engine.add_request("x", lora="a")


def test_an_adapter_for_another_base_is_refused_by_name(setup, tmp_path):
    base, a, _ = setup
    other = str(
        tiny_checkpoint(
            tmp_path / "other",
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=12,
            num_key_value_heads=4,
            initializer_range=0.2,
        )
    )
    engine = LLMEngine(other)
    engine.enable_lora(max_loras=1, max_lora_rank=8)
    with pytest.raises(
        ValueError,
        match=r"lora_A.weight has shape \(4, (36|72)\), the base model's "
        r"layer needs \(4, (48|96)\) \(an adapter for another base\)",
    ):
        engine.add_lora("a", a)
    small = LLMEngine(base)
    small.enable_lora(max_loras=1, max_lora_rank=2)
    with pytest.raises(ValueError, match="rank 4 is outside 1..--max-lora-rank 2"):
        small.add_lora("a", a)


def test_http_serves_adapters_by_model_name_and_loads_them_at_run_time(setup):
    """``llmlab serve --lora-modules a=DIR``: ``model`` picks the adapter or the base (both in
    flight at once), ``/v1/models`` lists it, load/unload at run time behind the API key, 404
    for a name not loaded."""
    import concurrent.futures
    import json
    import urllib.error
    import urllib.request

    from transformers import AutoTokenizer

    from llmlab.serve import start_server

    base, a, b = setup
    tok = AutoTokenizer.from_pretrained(base)
    key = {"Authorization": "Bearer finetune-key"}

    def post(url, body, headers=key):
        r = urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"} | headers
        )
        try:
            with urllib.request.urlopen(r, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def complete(url, model, prompt):
        return post(
            url + "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True},
        )

    with start_server(
        base,
        served_model_name="tiny",
        api_key="finetune-key",
        lora_modules={"a": str(a)},
        max_loras=2,
        max_lora_rank=8,
        num_gpu_blocks=64,
        block_size=8,
    ) as s:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            outs = list(
                pool.map(
                    lambda m: complete(s.url, m[0], m[1]),
                    [("a", PROMPTS[0]), ("tiny", PROMPTS[1]), ("tiny", PROMPTS[2])],
                )
            )
        want_a, want_base = _hf_greedy(base, a), _hf_greedy(base)
        texts = [o[1]["choices"][0]["text"] for o in outs]
        assert texts == [tok.decode(want_a[0]), tok.decode(want_base[1]), tok.decode(want_base[2])]
        r = urllib.request.Request(s.url + "/v1/models", headers=key)
        with urllib.request.urlopen(r, timeout=10) as resp:
            cards = {m["id"]: m for m in json.loads(resp.read())["data"]}
        assert sorted(cards) == ["a", "tiny"] and cards["a"]["parent"] == "tiny"
        assert complete(s.url, "b", PROMPTS[0])[0] == 404
        assert (
            post(s.url + "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(b)}, headers={})[0]
            == 401
        )
        assert post(s.url + "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(b)})[0] == 200
        status, body = complete(s.url, "b", PROMPTS[0])
        assert status == 200 and body["choices"][0]["text"] == tok.decode(_hf_greedy(base, b)[0])
        assert post(s.url + "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 200
        assert complete(s.url, "a", PROMPTS[0])[0] == 404
        assert post(s.url + "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 404
