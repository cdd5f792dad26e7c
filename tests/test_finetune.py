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


@pytest.mark.parametrize(
    "layout",
    [dict(dp=2), dict(tp=3, sequence_parallel=True), dict(pp=2, num_microbatches=2), dict(dp=2, zero=2)],
    ids=["dp2", "tp3+sp", "pp2", "zero2"],
)
def test_every_layout_gives_the_one_rank_losses_and_grad_norms(llama, one_rank, saved, layout):
    out = saved / "_".join(f"{k}{v}" for k, v in layout.items())
    m = llmlab.train(TrainConfig(init_from=llama, save_model=str(out), **KW, **layout), progress=False)
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
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"Who speaks to {a}?"},
                {"role": "assistant", "content": f"{b} speaks to {a}."},
            ]
        }
        for a in NAMES
        for b in NAMES
    ]
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
    assert ref[1][1] < ref[0][1]  # the held-out loss falls


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
    assert held and not held & seen  # held-out examples are never trained on


@pytest.mark.parametrize(
    "content, msg",
    [
        ('{"text": "ok"}\n{"text": "fine"}\nnot json\n', r"bad.jsonl:3: not JSON"),
        (
            '{"text": "ok"}\n{"prompt": "x"}\n',
            r"bad.jsonl:2: missing field: expected \"text\" or \"messages\"",
        ),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"bad.jsonl:1: .*no \"assistant\" message"),
        ('{"text": ""}\n', r"bad.jsonl:1: \"text\" must be a non-empty string"),
        ("\n\n", r"bad.jsonl: the file holds no example \(empty\)"),
        (
            '{"text": "' + "Romeo and Juliet " * 40 + '"}\n',
            r"bad.jsonl:1: the example is \d+ tokens, longer than --seq-len 64",
        ),
    ],
)
def test_bad_data_files_are_refused_naming_the_line(llama, tmp_path, content, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=msg):
        validate(TrainConfig(init_from=llama, data=str(f), seq_len=64))


# --- LoRA ------------------------------------------------------------------------------------
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_target="q_proj,v_proj,down_proj")


def test_lora_step_equals_transformers_and_peft(llama, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmlab.model.hf import load_hf_model
    from llmlab.model.lora import apply_lora, lora_state, save_peft_adapter

    targets = ["q_proj", "v_proj", "down_proj"]
    model = load_hf_model(llama)
    apply_lora(model, targets, 4, 8.0, seed=0)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    with torch.no_grad():  # B = 0 at init would make A's gradient zero: make both non-trivial
        for n, p in lora_state(model).items():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    save_peft_adapter(lora_state(model), tmp_path, base=llama, rank=4, alpha=8.0, targets=targets)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32), str(tmp_path), is_trainable=True
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 320, (2, 16), generator=g), torch.randint(0, 320, (2, 16), generator=g)
    y[0, :5] = -100
    ours = model(x, y)
    ours.backward()
    theirs = torch.nn.functional.cross_entropy(peft(input_ids=x).logits.flatten(0, 1), y.flatten())
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    grads = {
        n.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for n, p in peft.named_parameters()
        if p.requires_grad
    }
    ad = lora_state(model)
    assert sorted(grads) == sorted(ad) and len(ad) == 12
    for n, p in ad.items():
        assert p.grad.abs().max() > 0
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def lora_one_rank(llama, chat, saved):
    cfg = TrainConfig(
        init_from=llama,
        data=chat,
        save_model=str(saved / "adapter"),
        **LORA,
        **dict(DATA_KW, eval_every=0, steps=3),
    )
    return llmlab.train(cfg, progress=False)


@pytest.mark.parametrize("layout", [dict(dp=2, zero=2), dict(pp=2, num_microbatches=2)], ids=["zero2", "pp2"])
def test_lora_layouts_give_the_one_rank_losses_and_hold_no_base_state(
    llama, chat, lora_one_rank, layout, tmp_path
):
    kw = dict(init_from=llama, data=chat, **LORA, **dict(DATA_KW, eval_every=0, steps=3))
    m = llmlab.train(
        TrainConfig(**kw, **layout, checkpoint_dir=str(tmp_path), checkpoint_every=2), progress=False
    )
    ref = lora_one_rank["steps"]
    assert _gap(m["steps"], ref, "loss") < 1e-5
    assert _gap(m["steps"], ref, "grad_norm") < 1e-4
    # the checkpoint holds the adapters and their Adam states: a resume on one rank is exact
    import shutil

    shutil.rmtree(tmp_path / "step_00000003")
    resumed = llmlab.train(TrainConfig(**kw, checkpoint_dir=str(tmp_path), resume=True), progress=False)[
        "steps"
    ]
    assert [s["step"] for s in resumed] == [3]
    assert resumed[0]["loss"] == pytest.approx(ref[2]["loss"], rel=1e-5)
    adapters = 2 * 4 * ((36 + 36) + (36 + 12) + (72 + 36))  # layers x rank x (in + out)
    one = lora_one_rank["ranks"][0]["memory_bytes"]
    assert one["grads"] == 4 * adapters  # fp32 gradients of A and B only
    assert 8 * adapters <= one["optimizer_states"] <= 8 * adapters + 4 * 12  # Adam moments + steps
    assert one["params"] > 20 * one["grads"]  # the frozen base: no grads, no states
    assert sum(r["memory_bytes"]["grads"] for r in m["ranks"]) == 4 * adapters  # sharded / split


def test_lora_with_zero_in_bf16_casts_the_frozen_base_too(llama, chat, lora_one_rank):
    m = llmlab.train(
        TrainConfig(
            init_from=llama,
            data=chat,
            **LORA,
            dp=2,
            zero=1,
            dtype="bf16",
            **dict(DATA_KW, eval_every=0, steps=3),
        ),
        progress=False,
    )
    assert _gap(m["steps"], lora_one_rank["steps"], "loss") < 2e-2
    one = lora_one_rank["ranks"][0]["memory_bytes"]["params"]
    assert m["ranks"][0]["memory_bytes"]["params"] < 0.55 * one  # a bf16 base on every rank


def test_saved_adapter_loads_in_peft_and_gives_llmlab_logits(llama, lora_one_rank, saved):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmlab.model.hf import load_hf_model
    from llmlab.model.lora import apply_lora, load_peft_adapter

    config, state = load_peft_adapter(saved / "adapter")
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert all(t.abs().max() > 0 for t in state.values())  # trained: B moved away from 0
    model = load_hf_model(llama)
    apply_lora(model, config["target_modules"], config["r"], config["lora_alpha"])
    model.load_state_dict(state, strict=False)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32), str(saved / "adapter")
    ).merge_and_unload()
    ids = torch.tensor([[5, 17, 99, 200, 3, 42]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), peft(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_lora_under_tensor_parallelism_gives_the_one_rank_run_and_adapter(llama, chat, lora_one_rank, saved):
    """tp3 + SP composed with dp2 x ZeRO-2 (six ranks): A of q/v replicated, B split by rows; A of
    down_proj split by columns, B replicated (llmlab.parallel.tp_lora). The plain tp path (no
    ZeRO) is checked gradient by gradient in tests/test_tensor_parallel.py."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = saved / "adapter_tp3"
    layout = dict(tp=3, sequence_parallel=True, dp=2, zero=2)
    kw = dict(DATA_KW, eval_every=0, steps=3, seq_len=66)  # SP: 3 | seq_len; more padding, same loss
    m = llmlab.train(
        TrainConfig(init_from=llama, data=chat, **LORA, **kw, **layout, save_model=str(out)), progress=False
    )
    ref = lora_one_rank["steps"]
    assert _gap(m["steps"], ref, "loss") < 1e-5
    assert _gap(m["steps"], ref, "grad_norm") < 1e-4  # only the adapters have gradients
    one, tp = (
        load_file(str(saved / "adapter" / "adapter_model.safetensors")),
        load_file(str(out / "adapter_model.safetensors")),
    )
    assert sorted(one) == sorted(tp) and all(one[k].shape == tp[k].shape for k in one)
    assert max(((one[k] - tp[k]).abs().max() / one[k].abs().max()).item() for k in one) < 1e-3
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (saved / "adapter" / "adapter_config.json").read_text()
    )
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32), str(out)
    )
    loaded = {
        n.replace(".default", ""): p for n, p in peft.named_parameters() if ".lora_" in n
    }  # base_model.model.<name>.lora_A.default.weight
    assert sorted(loaded) == sorted(tp)
    assert all(torch.equal(loaded[n], tp[n]) for n in tp)


@pytest.mark.parametrize(
    "kw, err, msg",
    [
        (dict(lora_rank=0), ValueError, "--lora-rank must be >= 1"),
        (dict(lora_rank=13, lora_target="k_proj"), ValueError, r"--lora-rank 13 is larger than k_proj"),
        (dict(lora_rank=2, lora_target="qkv"), ValueError, "--lora-target 'qkv'"),
    ],
)
def test_bad_lora_flags_are_refused(llama, kw, err, msg):
    with pytest.raises(err, match=msg):
        validate(TrainConfig(init_from=llama, **kw))
