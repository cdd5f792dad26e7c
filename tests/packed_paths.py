"""Checks shared by the packed linear's own kernels (llmlab.kernels.amx_linear for bf16,
llmlab.kernels.panel_linear for fp32): a tiny engine's outputs with and without the kernel, and
a build that fails."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import pytest
import torch

from llmlab.inference import LLM, SamplingParams
from llmlab.kernels import cpu_isa, cpu_linear
from llmlab.model.llama import LlamaForCausalLM
from tiny_llama import TINY


def engine_outputs(monkeypatch: Any, kernel: ModuleType, dtype: torch.dtype, attr: str, runs: bool) -> list:
    """The greedy outputs (8 tokens, top-5 logprobs) of 4 prompts on a tiny engine with
    ``packed_linear``: first with ``kernel`` unavailable (oneDNN alone), then as this CPU has it.
    Checks the fused gate/up weight carries ``attr`` (the kernel's copy) exactly when ``runs``."""
    cfg = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128, vocab_size=128)
    prompts = [[(7 * i + j) % 128 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    out = []
    for on in (False, True):
        with monkeypatch.context() as m:
            if not on:
                m.setattr(kernel, "available", lambda *dtype: False)  # oneDNN alone
            llm = LLM(LlamaForCausalLM(cfg, seed=0), block_size=4, dtype=dtype, packed_linear=True)
        layer = llm.engine.runner.model.model.layers[0]
        assert hasattr(layer.mlp.fused_gate_up[0], attr) == (on and runs)
        out.append(llm.generate(prompts, params))
    return out


def check_failed_build(
    monkeypatch: Any,
    kernel: ModuleType,
    flags: set[str],
    dtype: torch.dtype,
    attr: str,
    by_dtype: bool = False,
) -> None:
    """On a CPU faked to have ``flags``, a build of ``kernel`` that fails warns once (naming the
    compiler's error and oneDNN), and packing a ``dtype`` weight then attaches no ``attr``.
    ``by_dtype``: the kernel's ``available`` takes the dtype."""
    from llmlab.kernels import cpu_build

    have = cpu_isa.effective_flags() | flags
    monkeypatch.setattr(cpu_isa, "effective_flags", lambda: have)  # such a CPU, anywhere
    monkeypatch.setattr(cpu_build, "available", lambda: True)
    builds = []

    def broken():
        builds.append(1)
        raise RuntimeError("Error building extension: the compiler's own message")

    monkeypatch.setattr(kernel, "_module", broken)
    kernel._built.cache_clear()
    try:
        with pytest.warns(UserWarning, match="did not build .*the compiler's own message.*stay on oneDNN"):
            assert (kernel.available(dtype) if by_dtype else kernel.available()) is False
        w = torch.randn(64, 64).to(dtype)
        cpu_linear.pack(w)  # no second build, no copy
        assert builds == [1] and not hasattr(w, attr)
    finally:
        kernel._built.cache_clear()
