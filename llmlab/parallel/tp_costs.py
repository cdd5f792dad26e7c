"""What tensor (and sequence) parallelism costs: the calculator, and the same quantities measured.

The formulas, per transformer block and per rank, are in :mod:`llmlab.formulas`:
communication :func:`~llmlab.formulas.communication.tp_block_comm_bytes` (and per step
:func:`~llmlab.formulas.communication.tp_step_comm_bytes`), saved activations
:func:`~llmlab.formulas.activations.llama_block_activation_bytes` (this model's count) beside
Korthikanti et al.'s :func:`~llmlab.formulas.activations.activation_bytes_per_layer`, FLOPs
:func:`~llmlab.formulas.compute.block_flops`.

:func:`tp_calculator` puts them side by side for a large block at several tp degrees;
:func:`measure_block` runs one block forward and backward on this rank and returns what was
actually moved and saved, to be shown next to the formulas.
"""

from __future__ import annotations

from typing import Any

import torch

from llmlab.formulas.activations import activation_bytes_per_layer, llama_block_activation_bytes
from llmlab.formulas.communication import ring_wire_factor, tp_block_comm_bytes
from llmlab.formulas.compute import block_flops
from llmlab.runtime.mesh import Mesh
from llmlab.model.config import ModelConfig


def tp_calculator(
    b: int = 16,
    s: int = 4096,
    h: int = 4096,
    f: int = 12288,
    a: int = 32,
    kv: int = 8,
    tps: tuple[int, ...] = (1, 2, 4, 8),
    dtype_bytes: int = 2,
    sequence_parallel: bool = False,
) -> list[dict[str, Any]]:
    """Per-rank cost of one block at each tp degree (defaults: the Qwen3-8B-like shape of the
    seed article, batch 16, sequence 4096, hidden 4096, MLP 12288, 32 heads, 8 kv heads, bf16).

    Returns one dict per degree: ``tp``, ``flops`` (forward+backward), ``weight_bytes``,
    ``activation_bytes`` (16-bit, Korthikanti's formula: explicit ``s x s`` scores, dropout),
    ``activation_bytes_fused`` (this model's count,
    :func:`~llmlab.formulas.activations.llama_block_activation_bytes`: fused attention, no dropout), ``comm_bytes`` (forward+backward
    payload), ``wire_bytes`` (what a ring algorithm sends per rank: ``2(t-1)/t`` of the payload
    for an all-reduce, ``(t-1)/t`` for an all-gather or reduce-scatter) and ``comm_per_flop``
    (ring wire bytes per FLOP, the ratio that grows with ``t``).
    """
    rows = []
    d = h // a
    params = h * a * d + 2 * h * kv * d + a * d * h + 3 * h * f + 2 * h
    for t in tps:
        comm = tp_block_comm_bytes(b, s, h, t, sequence_parallel, dtype_bytes)
        cb = sum(n * x for ph in comm.values() for n, x in ph.values())
        wire = sum(n * x * ring_wire_factor(k, t) for ph in comm.values() for k, (n, x) in ph.items())
        fl = block_flops(b, s, h, f, a, kv, t)["total"]
        rows.append(
            {
                "tp": t,
                "flops": fl,
                "weight_bytes": (params - 2 * h) * dtype_bytes / t + 2 * h * dtype_bytes,
                "activation_bytes": activation_bytes_per_layer(s, b, h, a, t, sequence_parallel),
                "activation_bytes_fused": llama_block_activation_bytes(
                    b, s, h, f, a, t, sequence_parallel, dtype_bytes
                ),
                "comm_bytes": cb,
                "wire_bytes": wire,
                "comm_per_flop": wire / fl,
            }
        )
    return rows


def measure_block(
    model_config: ModelConfig,
    mesh: Mesh,
    sequence_parallel: bool = False,
    batch: int = 2,
    seq_len: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """Run block 0 of a tensor-parallel model forward and backward on this rank (inside
    :func:`llmlab.launch` ranks; every rank calls it).

    Returns ``{"forward": [(kind, bytes), ...], "backward": [...], "activation_bytes": int,
    "output": tensor, "input_grad": tensor}``: the collectives in issue order, and the peak bytes
    saved for backward (parameters excluded), measured with
    :class:`~llmlab.metrics.memory.SavedActivations`. ``output``/``input_grad`` are this rank's
    (sequence shard under SP) for checks against the single-device block.
    """
    from llmlab.metrics.memory import SavedActivations
    from llmlab.model.llama import LlamaForCausalLM
    from llmlab.parallel.tp_plan import apply_tensor_parallel
    from llmlab.parallel.tp_comm import split_along
    from llmlab.runtime import comm

    model = LlamaForCausalLM(model_config.replace(num_hidden_layers=1), seed=seed)
    if mesh.size("tp") > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel)
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seq_len, model_config.hidden_size, generator=g)
    if sequence_parallel:
        x = split_along(x, 1, mesh.groups.get("tp"))
    x.requires_grad_(True)
    cos, sin = model.rotary(seq_len, x.device, x.dtype)
    comm.COUNTER.reset(record_events=True)
    with SavedActivations(list(layer.parameters()) + [cos, sin]) as act:
        out = layer(x, cos, sin)
    n_fwd = len(comm.COUNTER.events)
    out.backward(torch.ones_like(out))
    ev = [(k, b) for k, b, *_ in comm.COUNTER.events]
    comm.COUNTER.reset()
    return {
        "forward": ev[:n_fwd],
        "backward": ev[n_fwd:],
        "activation_bytes": act.peak,
        "output": out.detach(),
        "input_grad": x.grad,
    }
