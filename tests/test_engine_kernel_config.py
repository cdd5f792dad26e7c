"""The engine's kernel choices live in its EngineConfig (paged_attention, packed_linear, cpu_fused):
their defaults come from llmlab.kernels (LLMLAB_KERNELS, enable) when the config is made, an engine
keeps its own whatever the process-wide switch says afterwards, and two engines in one process can
differ; an EngineConfig is checked once on the way into an engine (LLM, LLMEngine, the serve
CLI's from_args + build_engines)."""

from __future__ import annotations

import pytest
import torch

import llmlab.kernels as K
from llmlab.cli import build_parser
from llmlab.inference import LLM, SamplingParams
from llmlab.inference import engine_config as ec
from llmlab.inference.engine_config import EngineConfig
from llmlab.kernels.cpu_linear import PackedLinear
from llmlab.model.llama import LlamaForCausalLM
from llmlab.serve import build_engines
from tiny_llama import TINY

CFG = TINY
PROMPTS = [[(7 * i + j) % 97 for j in range(5 + 3 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_defaults_come_from_llmlab_kernels_when_the_config_is_made():
    assert (EngineConfig().paged_attention, EngineConfig().packed_linear, EngineConfig().cpu_fused) == (
        K.settings().paged_attention,
        K.settings().packed_linear,
        K.settings().cpu_fused,
    )
    with K.use(paged_attention="cpu", packed_linear=True, cpu_fused=True):
        cfg = EngineConfig(block_size=8)
    assert (cfg.paged_attention, cfg.packed_linear, cfg.cpu_fused) == ("cpu", True, True)
    assert K._from_env("paged_attention=cpu,packed_linear,cpu_fused") == K.KernelSettings(
        paged_attention="cpu", packed_linear=True, cpu_fused=True
    )  # LLMLAB_KERNELS
    with pytest.raises(ValueError, match="paged_attention='cuda': supported values"):
        EngineConfig(paged_attention="cuda")


def test_each_engine_uses_its_own_choices(monkeypatch):
    """Two engines, one with every CPU fast path and one with none, in one process and with the
    process-wide switch off: each runs what its config says (the C++ operators are counted), and
    their greedy tokens agree (fp32)."""
    from llmlab.kernels import cpu_decode_stack, cpu_fused, cpu_paged_attention

    calls = {"fused": 0, "paged": 0, "stack": 0}  # (the decode stack calls both, for every layer, in C++)
    for mod, name, key in (
        (cpu_fused, "silu_mul", "fused"),
        (cpu_paged_attention, "paged_attention_cpu", "paged"),
        (cpu_decode_stack, "decode_layers", "stack"),
    ):
        real = getattr(mod, name)

        def counted(*a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, counted)
    fast = LLM(
        LlamaForCausalLM(CFG, seed=0), block_size=4, paged_attention="cpu", packed_linear=True, cpu_fused=True
    )  # (packing changes the model: one each)
    plain = LLM(
        LlamaForCausalLM(CFG, seed=0),
        block_size=4,
        paged_attention="reference",
        packed_linear=False,
        cpu_fused=False,
    )
    assert K.settings().cpu_fused is False and K.settings().paged_attention == "auto"
    assert type(fast.engine.runner.model.model.layers[0].self_attn.o_proj) is PackedLinear
    assert type(plain.engine.runner.model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert calls == {"fused": 0, "paged": 0, "stack": 0}
    got = [o.outputs[0].token_ids for o in fast.generate(PROMPTS, GREEDY)]
    assert got == want and all(len(t) == 8 for t in got)
    stacked = CFG.num_hidden_layers * calls["stack"]
    assert calls["fused"] + stacked >= 2 * 8 and calls["paged"] + stacked >= 2 * 8  # every layer, every step


def test_the_config_is_checked_once(monkeypatch):
    count = {"n": 0}
    check = EngineConfig.validate

    def counted(self):
        count["n"] += 1
        return check(self)

    monkeypatch.setattr(EngineConfig, "validate", counted)
    LLM(LlamaForCausalLM(CFG, seed=0), block_size=4)
    assert count["n"] == 1
    count["n"] = 0
    args = build_parser().parse_args(["serve", "--model", "tiny", "--block-size", "8"])
    config = ec.from_args(args)
    engines = build_engines(LlamaForCausalLM(CFG, seed=0), config=config)
    assert count["n"] == 1 and engines[0].engine.config is config
    for e in engines:
        e.shutdown()
