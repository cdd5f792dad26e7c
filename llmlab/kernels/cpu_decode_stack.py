"""A decode step's decoder layers in one C++ call: the CPU engine's answer to per-operator dispatch.

A decode step of a small model is a few hundred operator calls, each a few microseconds of
Python and PyTorch dispatch (slower still after each product has streamed its weight through the
caches). On ``benchmarks/bench_vs_vllm.py``'s workload (SmolLM2-135M, 30 layers, up to 64
sequences), one call per step took the decode steps from 65.2 to 61.7 ms (bf16) and from 118.5
to 111.6 ms (fp32) on average, alternating steps in one process (docs/kernels.md, "Session 18").
On a GPU, vLLM replays a decode step's kernels as a CUDA graph for the same reason. Here ``llmlab/kernels/csrc/decode_stack_cpu.cpp`` runs every
layer's operators from C++: the same C++ operators :meth:`llmlab.model.llama.DecoderLayer._serve_cpu`
calls one by one (fused RMSNorm, the panel products, RoPE, the cache write, the paged attention,
SwiGLU), reached through the entry points the other kernel modules export, in the same order on
the same tensors, so the hidden states are the same, bit for bit.

It takes a step only where every one of those operators would run anyway: one decode batch
(:meth:`~llmlab.inference.attention_context.PagedAttentionContext.cpu_decode_batch`), and
for every layer the model's own dense layer with all four products on panels
(:func:`llmlab.kernels.cpu_linear.panels_for`); :meth:`llmlab.model.llama.LlamaForCausalLM.run_layers`
decides, and otherwise runs the layers one by one. Built on first use like the other C++
kernels (:mod:`llmlab.kernels.cpu_build`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmlab.kernels import cpu_fused, cpu_paged_attention, panel_linear
from llmlab.kernels.cpu_build import load


class LayerWeights(NamedTuple):
    """What one layer hands the stack: its cache index, the two RMSNorm weights and epsilons, the
    panels (:func:`llmlab.kernels.cpu_linear.panels_for`) and biases of the fused q|k|v, o_proj,
    fused gate/up (SwiGLU panels where ``swiglu``) and down_proj products, the intermediate size
    and the sliding window (-1: none)."""

    layer_idx: int
    norm1: torch.Tensor
    eps1: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm2: torch.Tensor
    eps2: float
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    swiglu: bool
    down: torch.Tensor
    down_bias: torch.Tensor | None
    intermediate: int
    window: int


def _module():
    return load("decode_stack_cpu", "CPU decode stack (or enable(cpu_fused=False))")


def decode_layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    batch,
    slots: torch.Tensor,
    layers: list[LayerWeights],
    heads: tuple[int, int, int],
) -> torch.Tensor:
    """The layers of a decode step: ``x [N, hidden]`` (one new token per sequence), ``cos, sin
    [N, D]``, the engine's ``kv_cache [layers, 2, num_blocks, block_size, Hkv, D]``, the step's
    one decode ``batch`` (an :class:`~llmlab.inference.attention_context.AttentionBatch`) and
    ``slots [N]``, ``heads = (H, Hkv, D)`` -> ``[N, hidden]``, what the layers' serving forwards
    return in turn. Errors are the operators' (``RuntimeError`` naming the constraint)."""
    H, Hkv, D = heads
    return _module().decode_layers(
        x,
        cos,
        sin,
        kv_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_lens,
        slots,
        layers,
        H,
        Hkv,
        D,
        D**-0.5,
        cpu_fused._module().entry_points(),
        panel_linear._module().entry_points(),
        cpu_paged_attention._module().entry_points(),
    )
