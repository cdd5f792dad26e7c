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
