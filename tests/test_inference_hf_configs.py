"""Every Hugging Face config field that changes the maths is carried over or refused by name
(issue 18): explicit ``head_dim``, RoPE scaling ``linear`` and ``llama3``, Qwen2 sliding-window
attention (transformers' own ``layer_types`` rule), ``max_model_len`` beyond the positions.
Greedy tokens equal HF ``generate`` on tiny random checkpoints, fp64, through the paged engine
(small blocks, chunked prefill, prefix caching) and logits through the model's plain forward;
without each field's implementation the tokens differ (checked when the tests were written)."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmlab.inference import LLM, SamplingParams
from llmlab.model.hf import load_hf_model

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,
    eos_token_id=None,
    bos_token_id=1,
    pad_token_id=0,
)
PROMPTS = [[5, 9, 9, 14, 5, 30, 2, 7, 8, 11, 40, 41, 42, 3], [40, 41], list(range(4, 30))]
NEW = 10


def _save(path, kind: str, **over):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON | over))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON | over))
    model.save_pretrained(str(path))
    return path


def _hf_greedy(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            g = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW, pad_token_id=0
            )
            out.append(g[0, len(p) :].tolist())
    return hf, out


CASES = {
    "head_dim": ("llama", dict(head_dim=16)),  # 4 x 16 != hidden 32
    "rope_linear": (
        "llama",
        dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    ),
    "rope_llama3": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            }
        ),
    ),
    "qwen2_sliding": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1, tie_word_embeddings=False),
    ),
    "qwen2_unused_window": (
        "qwen2",
        dict(use_sliding_window=False, sliding_window=5, tie_word_embeddings=False),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_config_fields_match_hf(tmp_path, name):
    kind, over = CASES[name]
    path = _save(tmp_path / name, kind, **over)
    hf, want = _hf_greedy(path)
    model = load_hf_model(path, torch.float64)
    c = model.config
    if name == "head_dim":
        assert c.head_dim == 16 and model.model.layers[0].self_attn.q_proj.out_features == 64
    if name == "qwen2_sliding":  # transformers: layers >= max_window_layers slide
        assert c.sliding_window == 5 and c.sliding_window_layers == (1, 2)
    if name == "qwen2_unused_window":
        assert c.sliding_window_layers == () and c.sliding_window is None
    with torch.no_grad():  # the plain forward (training path) agrees too
        ids = torch.tensor([PROMPTS[2]])
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-9, atol=1e-9)
    llm = LLM(
        str(path),
        device="cpu",
        dtype=torch.float64,
        check_invariants=True,
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
    )
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_unsupported_fields_are_refused_by_name(tmp_path):
    path = _save(
        tmp_path / "yarn",
        "llama",
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 32,
        },
    )
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        LLM(str(path), device="cpu")
    path = _save(tmp_path / "ok", "llama")
    with pytest.raises(ValueError, match="max_model_len=256 .*max_position_embeddings=128"):
        LLM(str(path), device="cpu", max_model_len=256)
