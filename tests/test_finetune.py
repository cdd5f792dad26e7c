"""Fine-tuning a Hugging Face checkpoint (issue 42): ``--init-from`` under every layout."""
import json

import pytest
import torch
from hf_tiny import tiny_checkpoint

import llmlab
from llmlab.training.config import TrainConfig, validate

KW = dict(steps=3, global_batch_size=4, seq_len=36, seed=1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory.mktemp("hf") / "llama"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("saved")


@pytest.fixture(scope="module")
def one_rank(llama, saved):
    cfg = TrainConfig(init_from=llama, save_model=str(saved / "one"), **KW)
    return llmlab.train(cfg, progress=False)["steps"]


def _gap(steps, ref, key):
    return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(steps, ref, strict=True))


def test_first_step_loss_is_transformers_loss_on_the_same_batch(llama, one_rank):
    from transformers import AutoModelForCausalLM

    from llmlab.training.data_source import make_loader
    cfg = TrainConfig(init_from=llama, **KW)
    x, y = make_loader(cfg).global_batch(1)
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=x).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert one_rank[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert one_rank[-1]["loss"] < one_rank[0]["loss"]


@pytest.mark.parametrize("layout", [dict(dp=2), dict(tp=3, sequence_parallel=True),
                                    dict(pp=2, num_microbatches=2), dict(dp=2, zero=2)],
                         ids=["dp2", "tp3+sp", "pp2", "zero2"])
def test_every_layout_gives_the_one_rank_losses_and_grad_norms(llama, one_rank, saved, layout):
    out = saved / "_".join(f"{k}{v}" for k, v in layout.items())
    m = llmlab.train(TrainConfig(init_from=llama, save_model=str(out), **KW, **layout),
                     progress=False)
    assert _gap(m["steps"], one_rank, "loss") < 1e-5
    assert _gap(m["steps"], one_rank, "grad_norm") < 1e-4
    # --save-model gathers the shards: the same trained weights as one rank's
    from safetensors.torch import load_file
    a, b = load_file(str(saved / "one" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert not (out / ".llmlab-gather").exists()


def test_saved_model_loads_in_transformers_and_llmlab_with_equal_logits(one_rank, saved):
    from transformers import AutoModelForCausalLM

    from llmlab.inference.loader import load
    model, tok, eos, _ = load(str(saved / "one"))
    ids = torch.tensor([tok.encode("Thou art a villain")])
    hf = AutoModelForCausalLM.from_pretrained(str(saved / "one"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert eos == [tok.eos_token_id]


def test_unsupported_family_and_missing_pieces_are_named(tmp_path, llama):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (gpt2 / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"--init-from .*model_type='gpt2' is not supported"):
        validate(TrainConfig(init_from=str(gpt2)))
    with pytest.raises(ValueError, match="--init-from .* is not a folder"):
        validate(TrainConfig(init_from=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="--seq-len 200 exceeds max_position_embeddings 128"):
        validate(TrainConfig(init_from=llama, seq_len=200))


# --- --data: JSONL examples ------------------------------------------------------------------
NAMES = ["Romeo", "Juliet", "Macbeth", "Banquo", "Duncan", "Tybalt"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "chat.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Who speaks to {a}?"},
                           {"role": "assistant", "content": f"{b} speaks to {a}."}]}
             for a in NAMES for b in NAMES]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(f)


DATA_KW = dict(steps=4, global_batch_size=4, seq_len=64, seed=1, eval_every=2, lr=1e-2)


def test_chat_examples_train_on_the_assistant_tokens_only(llama, chat):
    from llmlab.data.jsonl import read_examples
    from llmlab.training.hf_init import load_tokenizer
    tok = load_tokenizer(llama)
    ex = read_examples(chat, tok, 64)[0]
    trained = tok.decode([i for i, t in zip(ex.ids, ex.trained) if t])
    assert trained == "Romeo speaks to Romeo.<|im_end|>\n"
    assert "Who speaks" in tok.decode(list(ex.ids))
    every = read_examples(chat, tok, 64, all_tokens=True)[0]
    assert all(every.trained) and every.ids == ex.ids


@pytest.fixture(scope="module")
def data_one_rank(llama, chat):
    return llmlab.train(TrainConfig(init_from=llama, data=chat, **DATA_KW), progress=False)["steps"]


@pytest.mark.parametrize("layout", [dict(dp=2, num_microbatches=2), dict(tp=3)], ids=["dp2xmb2", "tp3"])
def test_data_runs_give_the_one_rank_losses_and_eval_losses(llama, chat, data_one_rank, layout):
    m = llmlab.train(TrainConfig(init_from=llama, data=chat, **DATA_KW, **layout), progress=False)
    assert _gap(m["steps"], data_one_rank, "loss") < 1e-5
    evals = [(s["step"], s["eval_loss"]) for s in m["steps"] if "eval_loss" in s]
    ref = [(s["step"], s["eval_loss"]) for s in data_one_rank if "eval_loss" in s]
    assert [s for s, _ in evals] == [2, 4]
    assert [v for _, v in evals] == pytest.approx([v for _, v in ref], rel=1e-5)
    assert ref[1][1] < ref[0][1]     # the held-out loss falls


def test_data_order_is_a_function_of_seed_and_step(llama, chat):
    from llmlab.training.data_source import make_loader
    cfg = TrainConfig(init_from=llama, data=chat, **DATA_KW)
    a, b = make_loader(cfg), make_loader(cfg)
    later = b.global_batch(11)[0]
    for s in range(1, 12):
        a.global_batch(s)
    assert torch.equal(a.global_batch(11)[0], later)
    assert not torch.equal(a.global_batch(11)[0], a.global_batch(10)[0])
    held = set(map(tuple, a.eval_batch()[0].tolist()))
    seen = {tuple(r) for s in range(1, 30) for r in a.global_batch(s)[0].tolist()}
    assert held and not held & seen            # held-out examples are never trained on


@pytest.mark.parametrize("content, msg", [
    ('{"text": "ok"}\n{"text": "fine"}\nnot json\n', r"bad.jsonl:3: not JSON"),
    ('{"text": "ok"}\n{"prompt": "x"}\n', r"bad.jsonl:2: missing field: expected \"text\" or \"messages\""),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"bad.jsonl:1: .*no \"assistant\" message"),
    ('{"text": ""}\n', r"bad.jsonl:1: \"text\" must be a non-empty string"),
    ("\n\n", r"bad.jsonl: the file holds no example \(empty\)"),
    ('{"text": "' + "Romeo and Juliet " * 40 + '"}\n', r"bad.jsonl:1: the example is \d+ tokens, longer than --seq-len 64"),
])
def test_bad_data_files_are_refused_naming_the_line(llama, tmp_path, content, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=msg):
        validate(TrainConfig(init_from=llama, data=str(f), seq_len=64))
