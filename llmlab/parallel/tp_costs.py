"""What tensor (and sequence) parallelism costs: formulas, and the same quantities measured.

Formulas, per transformer block and per rank, for ``b`` sequences of ``s`` tokens, hidden ``h``,
MLP width ``f``, ``a`` query heads, ``kv`` key/value heads, tp degree ``t``:

* communication (Megatron-LM, Shoeybi et al. 2019, §3): without SP two all-reduces forward and two
  backward, each of the full activation ``b*s*h`` elements. With SP (Korthikanti et al. 2022,
  §4.2.2) each all-reduce becomes an all-gather plus a reduce-scatter of the same payload, and
  re-gathering the saved sequence shard in backward adds one all-gather per column group (2 per
  block). Bytes follow :mod:`llmlab.runtime.comm`'s payload convention (full tensor).
* saved activations (this model: fp32, RMSNorm, SwiGLU, GQA, no dropout, PyTorch's fused
  attention that keeps ``q, k, v, out`` and a ``logsumexp`` instead of the ``s x s`` scores):
  elements saved for backward =
  ``6bsh + 2bs`` (two norms: input, normalised input, output, 1/rms) + ``4bsh/t`` (q, k, v after
  the kv heads are repeated, and the attention output, which is also o_proj's input: the fused
  kernel writes it ``[b, s, a, d]``-contiguous so the reshape is a view) + ``bsa/t`` (logsumexp) + ``4bsf/t``
  (gate, silu(gate), up, their product). Sequence parallelism divides the first term by ``t`` as
  well, so everything is ``1/t``. Compare Korthikanti et al. 2022, Table 2 (16-bit, dropout,
  explicit ``s x s`` scores): ``sbh(10 + 24/t + 5as/(ht))`` and ``sbh(34 + 5as/h)/t`` with SP.
* FLOPs: ``2 * b * s * (weights' inputs x outputs)`` per matmul forward, plus ``4 * b * s^2 * h``
  for the attention scores and values (causal masking not subtracted), all divided by ``t``;
  backward is twice the forward.

:func:`measure_block` runs one block forward and backward on this rank and returns what was
actually moved and saved, to be shown next to :func:`block_comm_bytes` and
:func:`block_activation_bytes`.
"""
from __future__ import annotations

import torch


def block_comm_bytes(b: int, s: int, h: int, t: int, sequence_parallel: bool = False,
                     dtype_bytes: int = 4) -> dict:
    """Collectives of one block for one micro-batch: ``{"forward": {kind: (count, bytes_each)},
    "backward": {...}}`` (bytes per collective, payload convention of :mod:`llmlab.runtime.comm`)."""
    if t == 1:
        return {"forward": {}, "backward": {}}
    x = b * s * h * dtype_bytes
    if not sequence_parallel:
        return {"forward": {"all_reduce": (2, x)}, "backward": {"all_reduce": (2, x)}}
    return {"forward": {"all_gather": (2, x), "reduce_scatter": (2, x)},
            "backward": {"all_gather": (4, x), "reduce_scatter": (2, x)}}


def block_activation_bytes(b: int, s: int, h: int, f: int, a: int, t: int,
                           sequence_parallel: bool = False, dtype_bytes: int = 4) -> int:
    """Bytes this model's block saves for backward on one rank (formula in the module doc)."""
    replicated = 6 * b * s * h + 2 * b * s
    sharded = (4 * b * s * h + b * s * a + 4 * b * s * f) // t
    if sequence_parallel:
        replicated //= t
    return (replicated + sharded) * dtype_bytes


def korthikanti_activation_bytes(b: int, s: int, h: int, a: int, t: int,
                                 sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022, Table 2: bytes per layer for a GPT block in 16-bit with dropout
    and explicit attention scores (4h MLP, no recomputation)."""
    if sequence_parallel:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def block_flops(b: int, s: int, h: int, f: int, a: int, kv: int, t: int = 1) -> dict:
    """Per-rank FLOPs of one block: ``{"forward", "backward", "total"}`` (2 FLOPs per MAC)."""
    d = h // a
    weights = h * (a * d) + 2 * h * (kv * d) + (a * d) * h + 3 * h * f
    fwd = (2 * b * s * weights + 4 * b * s * s * h) / t
    return {"forward": fwd, "backward": 2 * fwd, "total": 3 * fwd}


def tp_calculator(b: int = 16, s: int = 4096, h: int = 4096, f: int = 12288, a: int = 32,
                  kv: int = 8, tps=(1, 2, 4, 8), dtype_bytes: int = 2,
                  sequence_parallel: bool = False) -> list[dict]:
    """Per-rank cost of one block at each tp degree (defaults: the Qwen3-8B-like shape of the
    seed article, batch 16, sequence 4096, hidden 4096, MLP 12288, 32 heads, 8 kv heads, bf16).

    Returns one dict per degree: ``tp``, ``flops`` (forward+backward), ``weight_bytes``,
    ``activation_bytes`` (16-bit, Korthikanti's formula: explicit ``s x s`` scores, dropout),
    ``activation_bytes_fused`` (this model's formula, :func:`block_activation_bytes`: fused
    attention, no dropout), ``comm_bytes`` (forward+backward
    payload), ``wire_bytes`` (what a ring algorithm sends per rank: ``2(t-1)/t`` of the payload
    for an all-reduce, ``(t-1)/t`` for an all-gather or reduce-scatter) and ``comm_per_flop``
    (ring wire bytes per FLOP, the ratio that grows with ``t``).
    """
    rows = []
    d = h // a
    params = h * a * d + 2 * h * kv * d + a * d * h + 3 * h * f + 2 * h
    for t in tps:
        comm = block_comm_bytes(b, s, h, t, sequence_parallel, dtype_bytes)
        cb = sum(n * x for ph in comm.values() for n, x in ph.values())
        wire = sum(n * x * (t - 1) / t * (2 if k == "all_reduce" else 1)
                   for ph in comm.values() for k, (n, x) in ph.items())
        fl = block_flops(b, s, h, f, a, kv, t)["total"]
        rows.append({"tp": t, "flops": fl,
                     "weight_bytes": (params - 2 * h) * dtype_bytes / t + 2 * h * dtype_bytes,
                     "activation_bytes": korthikanti_activation_bytes(b, s, h, a, t, sequence_parallel),
                     "activation_bytes_fused": block_activation_bytes(b, s, h, f, a, t, sequence_parallel,
                                                                      dtype_bytes),
                     "comm_bytes": cb, "wire_bytes": wire, "comm_per_flop": wire / fl})
    return rows


def measure_block(model_config, mesh, sequence_parallel: bool = False, batch: int = 2,
                  seq_len: int = 32, seed: int = 0) -> dict:
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
    from llmlab.parallel.tensor_parallel import apply_tensor_parallel
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
    return {"forward": ev[:n_fwd], "backward": ev[n_fwd:], "activation_bytes": act.peak,
            "output": out.detach(), "input_grad": x.grad}
