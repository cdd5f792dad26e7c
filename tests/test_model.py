"""The reference model: shapes, parameter count, layout-independent init, HF equality."""

import math

import pytest
import torch

from llmlab.model.config import PRESETS, ModelConfig, get_preset
from llmlab.model.hf import load_hf_model, save_hf_checkpoint
from llmlab.model.llama import LlamaForCausalLM, init_weights


def test_forward_shapes_and_initial_loss_near_uniform():
    m = LlamaForCausalLM(get_preset("tiny"), seed=0)
    x = torch.randint(0, 256, (3, 17))
    assert m(x).shape == (3, 17, 256)
    loss = m(x, x).item()
    assert abs(loss - math.log(256)) < 0.1  # small init: close to the uniform distribution


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_num_parameters_matches_the_module(name):
    cfg = get_preset(name)
    m = LlamaForCausalLM(cfg, seed=None)
    assert cfg.num_parameters() == sum(p.numel() for p in m.parameters())
    tied = cfg.replace(tie_word_embeddings=True, attention_bias=True)
    m = LlamaForCausalLM(tied, seed=None)
    assert tied.num_parameters() == sum(p.numel() for p in m.parameters())


def test_init_depends_only_on_seed_and_names():
    a = LlamaForCausalLM(get_preset("tiny"), seed=3)
    b = LlamaForCausalLM(get_preset("tiny"), seed=None)

    class Reversed(torch.nn.Module):  # visits b's parameters in reverse order
        def __init__(self, m):
            super().__init__()
            self.config, self.inner = m.config, [m]

        def named_parameters(self, *a, **k):
            return reversed(list(self.inner[0].named_parameters()))

    init_weights(Reversed(b), 3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    c = LlamaForCausalLM(get_preset("tiny"), seed=4)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_causality_future_tokens_do_not_change_past_logits():
    m = LlamaForCausalLM(get_preset("tiny"), seed=0)
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    assert torch.allclose(m(x)[0, :8], m(y)[0, :8], atol=1e-6)
    assert not torch.allclose(m(x)[0, 8:], m(y)[0, 8:])


def test_bad_config_names_the_constraint():
    with pytest.raises(ValueError, match="num_key_value_heads=3 must divide num_attention_heads=4"):
        ModelConfig(num_key_value_heads=3).validate()
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_preset("huge")
    assert {"tiny", "tiny-moe", "small"} <= set(PRESETS)


def _hf_pair(tmp_path, kind, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama, Qwen2Config, Qwen2ForCausalLM

    cls, cfg_cls = (HFLlama, LlamaConfig) if kind == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    torch.manual_seed(0)
    cfg = cfg_cls(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **kw,
    )
    hf = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases so a mapping mistake shows
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"attention_bias": True}),
    ],
)
def test_hf_checkpoint_gives_the_same_logits_as_transformers(tmp_path, kind, kw):
    hf = _hf_pair(tmp_path, kind, **kw)
    ours = load_hf_model(tmp_path).eval()
    x = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x)
    assert torch.allclose(ref, got, atol=1e-5, rtol=1e-5), (ref - got).abs().max()


def test_llmlab_model_saved_as_hf_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    m = LlamaForCausalLM(get_preset("tiny"), seed=1).eval()
    save_hf_checkpoint(m, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, m(x), atol=1e-5)


def test_unsupported_checkpoints_are_refused_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        load_hf_model(tmp_path)
