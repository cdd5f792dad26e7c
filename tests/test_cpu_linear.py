"""Linear layers through oneDNN-prepacked weights equal F.linear (to the GEMM's rounding), the
packing keeps the model's parameters and state_dict, and the engine's greedy tokens with packed
weights equal those without."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import llmlab.kernels as K
from llmlab.inference import LLM, SamplingParams
from llmlab.kernels.cpu_linear import PackedLinear, linear, pack, pack_linears
from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_weight_equals_f_linear(dtype, tol, rows):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 40, generator=g) * 0.1).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(1, rows, 40, generator=g).to(dtype)
    want = F.linear(x, w, b)
    assert linear(x, w, b) is not None and not hasattr(w, "_packed")     # unpacked: F.linear
    pack(w)
    got = linear(x, w, b)
    assert got.shape == (1, rows, 96) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="CPU fp32/bf16/fp16"):
        pack(torch.zeros(4, 4, dtype=torch.float64))


CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True)


def test_pack_linears_keeps_parameters_and_state_dict():
    model = LlamaForCausalLM(CFG, seed=0).eval().fuse_projections()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        want = model(x)
        n = pack_linears(model)
        got = model(x)
    # per layer: the fused q/k/v and gate/up weights, o_proj, down_proj; lm_head (tied)
    assert n == 2 * 4 + 1
    assert type(model.lm_head) is PackedLinear and model.lm_head.weight is model.model.embed_tokens.weight
    layer = model.model.layers[0]
    assert hasattr(layer.self_attn.fused_qkv[0], "_packed") and hasattr(layer.mlp.fused_gate_up[0], "_packed")
    assert type(layer.self_attn.q_proj) is nn.Linear and not hasattr(layer.self_attn.q_proj.weight, "_packed")
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_engine_tokens_equal_with_packed_weights():
    model = LlamaForCausalLM(CFG, seed=0)
    prompts = [[(7 * i + j) % 97 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = {}
    for packed in (False, True):
        with K.use(packed_linear=packed):
            llm = LLM(model, block_size=4)
            assert (type(llm.engine.runner.model.model.layers[0].self_attn.o_proj) is PackedLinear) == packed
            out[packed] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out[True] == out[False] and all(len(t) == 10 for t in out[True])
    assert K._from_env("packed_linear").packed_linear is True
