"""Linear layers through oneDNN-prepacked weights equal F.linear (to the GEMM's rounding), the
packing keeps the model's parameters and state_dict, and the engine's greedy tokens with packed
weights equal those without. Each case runs at this CPU's level and with LLMLAB_CPU_ISA forcing
the level below it (there bf16 and fp16 weights are packed widened to fp32: tests/test_cpu_isa.py
checks the choice on other CPUs' flag sets); under ONEDNN_MAX_CPU_ISA=AVX2, where oneDNN itself
refuses bf16 as on an AVX2-only CPU, the bf16 engine serves through the widened weights."""

from __future__ import annotations

import dataclasses

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import llmlab.kernels as K
from llmlab.inference import LLM, SamplingParams
from llmlab.kernels import cpu_isa, cpu_linear
from llmlab.kernels.cpu_linear import PackedLinear, linear, pack, pack_linears, path
from llmlab.model.llama import LlamaForCausalLM
from tiny_llama import TINY

LEVELS = [None] + [lv for lv in [cpu_isa.fallback()] if lv]  # the current level, and the one below


@pytest.fixture(params=LEVELS, ids=lambda lv: lv or "native")
def level(request, monkeypatch):
    if request.param:
        monkeypatch.setenv(cpu_isa.ENV, request.param)
    return cpu_isa.cpu_isa()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_weight_equals_f_linear(dtype, tol, rows, level):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 40, generator=g) * 0.1).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(1, rows, 40, generator=g).to(dtype)
    want = F.linear(x, w, b)
    assert linear(x, w, b) is not None and not hasattr(w, "_packed")  # unpacked: F.linear
    packed = pack(w)
    assert (packed is not None) == (path(dtype) != "aten") == hasattr(w, "_packed")
    if dtype != torch.float32 and level in ("avx2", "generic"):  # no bf16/fp16 packing without AVX-512
        assert path(dtype) == "onednn-fp32" and packed is not None and packed.dtype == torch.float32
    got = linear(x, w, b)
    assert got.shape == (1, rows, 96) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    few = cpu_linear.WIDENED_MIN_ROWS_PANELS if hasattr(w, "_panels") else cpu_linear.WIDENED_MIN_ROWS
    if path(dtype) == "onednn-fp32" and rows < few:
        assert torch.equal(got, want)  # a few rows: F.linear's own product (half the bytes to read)
    if path(dtype) == "onednn-fp32":  # the fp32 product, rounded once: within one ulp of dtype
        exact = F.linear(x.float(), w.float(), b.float())
        ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((got.float() - exact).abs() <= ulp).all()


def test_widened_weights_take_the_fp32_panels_for_2_to_64_rows(monkeypatch):
    """As on an AVX2-only CPU (the path forced here): a bf16 weight is packed widened, with fp32
    panels where the CPU has them (AVX2), which products of 2-64 rows take; 1 row is F.linear's,
    more than 64 oneDNN's. A fused bf16 gate/up weight gets no SwiGLU panels (those are bf16)."""
    from llmlab.kernels import panel_linear

    monkeypatch.setattr(
        cpu_linear, "path", lambda dtype, flags=None: "onednn" if dtype == torch.float32 else "onednn-fp32"
    )
    g = torch.Generator().manual_seed(3)
    w, b = (torch.randn(96, 80, generator=g) * 0.1).bfloat16(), torch.randn(96, generator=g).bfloat16()
    pack(w)
    has = panel_linear.available()
    assert w._packed.dtype == torch.float32 and hasattr(w, "_panels") == has
    assert not has or (
        w._panels.dtype == torch.float32 and torch.equal(w._panels, panel_linear.pack(w.float()))
    )
    calls = []
    real = panel_linear.linear
    monkeypatch.setattr(
        panel_linear, "linear", lambda x, p, n, bias=None: calls.append(len(x)) or real(x, p, n, bias)
    )
    for rows in (1, 2, 3, 64, 65):
        x = torch.randn(rows, 80, generator=g).bfloat16()
        got, exact = linear(x, w, b), F.linear(x.float(), w.float(), b.float())
        assert got.dtype == torch.bfloat16
        if rows == 1:
            assert torch.equal(got, F.linear(x, w, b))
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((got.float() - exact).abs() <= ulp).all()
    assert calls == ([2, 3, 64] if has else [])
    model = LlamaForCausalLM(CFG, seed=0).to(torch.bfloat16).eval().fuse_projections()
    pack_linears(model)
    gate_up = model.model.layers[0].mlp.fused_gate_up[0]
    assert gate_up._packed.dtype == torch.float32 and not hasattr(gate_up, "_swiglu")


def test_widened_path_needs_onednn(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    assert [path(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == ["aten"] * 3
    w = torch.randn(8, 4).bfloat16()
    assert pack(w) is None and not hasattr(w, "_packed")


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="CPU fp32/bf16/fp16"):
        pack(torch.zeros(4, 4, dtype=torch.float64))


CFG = dataclasses.replace(TINY, tie_word_embeddings=True)


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


def test_engine_tokens_equal_with_packed_weights(level):
    model = LlamaForCausalLM(CFG, seed=0)
    prompts = [[(7 * i + j) % 97 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = {}
    for packed in (False, True):  # (False first: packing changes the model)
        llm = LLM(model, block_size=4, packed_linear=packed)  # the engine's own choice
        assert (type(llm.engine.runner.model.model.layers[0].self_attn.o_proj) is PackedLinear) == packed
        out[packed] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out[True] == out[False] and all(len(t) == 10 for t in out[True])
    assert K._from_env("packed_linear").packed_linear is True


AVX2_ONEDNN = """
import torch
from llmlab.inference import LLM, SamplingParams
from llmlab.kernels import cpu_linear
from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM
try:                       # what an AVX2-only CPU does: oneDNN refuses to pack bf16
    torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 64)
    raise SystemExit("oneDNN packed bf16 under ONEDNN_MAX_CPU_ISA=AVX2")
except RuntimeError as e:
    assert "bf16 path needs the cpu support" in str(e), e
assert cpu_linear.path(torch.bfloat16) == "onednn-fp32" and cpu_linear.path(torch.float32) == "onednn"
cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
out = []
for packed in (True, False):
    llm = LLM(LlamaForCausalLM(cfg, seed=0), block_size=4, dtype=torch.bfloat16, packed_linear=packed)
    o_proj = llm.engine.runner.model.model.layers[0].self_attn.o_proj.weight
    assert o_proj.dtype == torch.bfloat16  # the weight stays; with packing, its fp32 widening beside it
    assert getattr(o_proj, "_packed", None) is None if not packed else o_proj._packed.dtype == torch.float32
    out.append([o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], params)])
assert out[0] == out[1] and len(out[0][0]) == 8, out
print("served", out[0])
"""


def test_bf16_engine_serves_where_onednn_refuses_bf16():
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN on this machine refuse bf16 as it does on an AVX2-only
    CPU (the subprocess checks it does): with packed_linear the bf16 engine packs its weights
    widened to fp32 and serves the same tokens as F.linear's bf16 product without packing."""
    env = {k: v for k, v in os.environ.items() if k != cpu_isa.ENV} | {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    r = subprocess.run(
        [sys.executable, "-c", AVX2_ONEDNN], env=env, capture_output=True, text=True, check=False, timeout=300
    )
    assert r.returncode == 0 and "served" in r.stdout, r.stderr[-3000:]
