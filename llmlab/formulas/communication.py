"""Communication: what collectives send, and how long they take in one α-β model.

**Time.** A ring all-reduce of S bytes on N ranks is a reduce-scatter then an all-gather, each
N−1 steps; in every step a rank sends one chunk of S/N bytes to its neighbour. With α the latency
of one step (seconds) and β the bandwidth of one link (bytes/s), each step costs α + S/(N·β), so

    t = 2(N−1)·(α + S/(N·β)) = 2(N−1)·α + 2(N−1)/N · S/β

(Thakur, Rabenseifner & Gropp 2005, §4; Patarasuk & Yuan 2009). β is what nccl-tests calls the
bus bandwidth (busbw), as ``llmlab bench comm`` measures it. :func:`ring_all_reduce_time` is the
only implementation: lab 00 fits α and β to measured all-reduces with it, lab 01 predicts a DDP
step with it, ``llmlab estimate`` prints the communication wall with it.

**Bytes.** Two conventions, both used in llmlab:

* *payload*: the bytes of the whole tensor a collective works on (all-reduce: the tensor;
  all-gather: the gathered output; reduce-scatter: the unsharded input). This is what
  :mod:`llmlab.runtime.comm` counts per call and what ``--metrics-json`` reports.
* *wire*: the bytes one rank sends in a ring algorithm: payload × :func:`ring_wire_factor`,
  2(N−1)/N for an all-reduce and (N−1)/N for an all-gather or reduce-scatter.

Per step: DDP and ZeRO (:func:`zero_comm_bytes_per_step`, ZeRO §7), tensor and sequence
parallelism (:func:`tp_block_comm_bytes`, :func:`tp_step_comm_bytes`; Megatron-LM, Shoeybi et
al. 2019, §3; Korthikanti et al. 2022, §4.2.2).
"""

from __future__ import annotations

import math
from typing import Any

from llmlab.formulas._checks import check_count, check_ranks, check_stage
from llmlab.formulas.memory import dtype_bytes, model_state_bytes

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


# ------------------------------------------------------------------------------------------
# One collective
# ------------------------------------------------------------------------------------------
def ring_wire_factor(op: str, world_size: int | None) -> float:
    """Wire bytes per payload byte that one rank sends in a ring ``op`` over ``world_size`` ranks:
    2(N−1)/N for ``all_reduce``, (N−1)/N for ``all_gather``, ``reduce_scatter`` and
    ``all_to_all``. ``world_size=None`` is the large-N limit (2 or 1). This is also nccl-tests'
    busbw/algbw ratio. Raises ``ValueError`` for another ``op`` or ``world_size`` < 1.
    """
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(COLLECTIVES)}")
    phases = 2 if op == "all_reduce" else 1
    if world_size is None:
        return float(phases)
    n = check_ranks(world_size, "world_size")
    return phases * (n - 1) / n


def ring_factor(world_size: int | None = None) -> float:
    """Bytes a ring all-reduce sends per rank, per byte reduced: 2(N−1)/N; 2 when N is None."""
    return ring_wire_factor("all_reduce", world_size)


def ring_all_reduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``: 2(N−1)/N · S."""
    return ring_factor(world_size) * nbytes


def ring_all_reduce_time(
    nbytes: float, world_size: int | None, bandwidth: float, latency: float = 0.0
) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` bytes over ``world_size`` ranks (α-β model).

    ``t = 2(N−1)·(α + S/(N·β))``: 2(N−1) steps, each paying the latency ``latency`` (α, seconds)
    and sending one chunk S/N at ``bandwidth`` (β, bytes/s per link, nccl-tests' busbw). One
    rank sends nothing (t = 0). ``world_size=None`` is the large-N limit 2·S/β (bandwidth term
    only; it needs ``latency=0``, since 2(N−1)·α grows without bound).

    Raises:
        ValueError: negative ``nbytes``, ``bandwidth`` <= 0, ``world_size`` < 1, negative
        ``latency``, or a latency with ``world_size=None``.

    Source: Thakur, Rabenseifner & Gropp 2005, §4 (ring/"Rabenseifner" all-reduce cost).
    """
    check_count("nbytes", nbytes, allow_zero=True)
    check_count("bandwidth", bandwidth)
    check_count("latency", latency, allow_zero=True)
    if world_size is None:
        if latency:
            raise ValueError("latency needs a world_size: a ring pays it 2(N-1) times")
        return ring_factor(None) * nbytes / bandwidth
    n = check_ranks(world_size, "world_size")
    return 2 * (n - 1) * (latency + nbytes / (n * bandwidth))


def collective_time(op: str, nbytes: float, world_size: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds for one ring ``op`` on ``nbytes`` of payload over ``world_size`` ranks (α-β model).

    ``all_reduce`` is :func:`ring_all_reduce_time`, 2(N−1) steps; ``all_gather``,
    ``reduce_scatter`` and ``all_to_all`` take N−1 steps, each α + S/(N·β):
    ``t = (N−1)·(α + S/(N·β))``. ``nbytes`` is the payload convention (the gathered output, the
    unsharded input, one rank's send buffer); ``bandwidth`` is busbw in bytes/s. One rank: 0 s.

    Raises ``ValueError`` for an unknown ``op`` or as :func:`ring_all_reduce_time`.
    Source: Thakur, Rabenseifner & Gropp 2005, §3-4; nccl-tests ``doc/PERFORMANCE.md``.
    """
    ring_wire_factor(op, world_size)
    if op == "all_reduce":
        return ring_all_reduce_time(nbytes, world_size, bandwidth, latency)
    check_count("nbytes", nbytes, allow_zero=True)
    check_count("bandwidth", bandwidth)
    check_count("latency", latency, allow_zero=True)
    return (world_size - 1) * (latency + nbytes / (world_size * bandwidth))


def p2p_time(nbytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds to send ``nbytes`` from one rank to another: ``α + S/β`` (0 for 0 bytes), as a
    pipeline stage sends its activations forward and their gradients back. ``ValueError`` for a
    negative size or latency or a non-positive bandwidth."""
    check_count("nbytes", nbytes, allow_zero=True)
    check_count("bandwidth", bandwidth)
    check_count("latency", latency, allow_zero=True)
    return latency + nbytes / bandwidth if nbytes else 0.0


# ------------------------------------------------------------------------------------------
# Data parallelism and ZeRO
# ------------------------------------------------------------------------------------------
def zero_comm_bytes_per_step(
    num_params: float, stage: int, dp: int | None = None, dtype: str = "fp32"
) -> dict:
    """Bytes one rank sends per step for the gradient/parameter collectives of DDP or ZeRO.

    stage 0 (DDP): one all-reduce of the gradients; stages 1 and 2: reduce-scatter of the
    gradients + all-gather of the updated parameters (same 2Ψ); stage 3: an all-gather of the
    parameters in forward, another in backward, and a reduce-scatter: 3Ψ, 1.5× DDP. Wire bytes
    use :func:`ring_wire_factor`; ``dp=None`` uses the large-N limit (the paper's Ψ units).
    Elements are ``dtype`` wide (gradients and 16-bit weights). One micro-batch per step.

    Returns:
        ``{"all_reduce", "reduce_scatter", "all_gather", "total"}`` wire bytes sent per rank
        per step, and ``"payload"``: the same collectives in llmlab's counter convention
        (:mod:`llmlab.runtime.comm`: bytes of the full tensor per call, no ring factor).

    Source: ZeRO (Rajbhandari et al. 2020), §7.2.1 and §7.2.2.
    """
    check_stage(stage)
    check_count("num_params", num_params)
    full = dtype_bytes(dtype) * num_params
    calls = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
    if stage == 0:
        calls["all_reduce"] = 1
    else:
        calls["reduce_scatter"] = 1
        calls["all_gather"] = 2 if stage == 3 else 1
    out: dict[str, Any] = {k: round(n * full * ring_wire_factor(k, dp)) for k, n in calls.items()}
    out["total"] = sum(out.values())
    out["payload"] = {k: round(n * full) for k, n in calls.items()}
    return out


def communication_wall(
    num_params: float,
    num_tokens: float,
    tokens_per_step: float,
    bandwidth_bytes_per_s: float,
    dtype: str = "fp32",
    activation_comm_bytes: float = 0.0,
    world_size: int | None = None,
    latency_s: float = 0.0,
) -> dict:
    """Per-step and total time spent communicating, the source articles' way.

    Per step the gradients (Ψ × dtype bytes) plus ``activation_comm_bytes`` go through one ring
    all-reduce (:func:`ring_all_reduce_time`; ``world_size=None``: the large-N factor 2).
    Steps = tokens / tokens_per_step (rounded up). No overlap with compute is assumed: this is
    the wall, not the achieved step time.

    Returns:
        ``{"grad_bytes", "activation_bytes", "bytes_per_step", "ring_factor", "time_per_step_s",
        "num_steps", "total_time_s"}``.

    Example (the source articles): 8e9 fp32 parameters, 80e9 activation bytes, 2.5e11 tokens,
    4e6 tokens per step, 64e9 B/s: 112e9 bytes per step, 2 × 112 GB / 64 GB/s = 3.5 s,
    62,500 steps, 218,750 s = 60.76 h.
    """
    check_count("num_tokens", num_tokens)
    check_count("tokens_per_step", tokens_per_step)
    check_count("activation_comm_bytes", activation_comm_bytes, allow_zero=True)
    grads = model_state_bytes(num_params, dtype, "sgd")["grads"]
    per_step = grads + activation_comm_bytes
    t = ring_all_reduce_time(per_step, world_size, bandwidth_bytes_per_s, latency_s)
    steps = math.ceil(num_tokens / tokens_per_step)
    return {
        "grad_bytes": grads,
        "activation_bytes": activation_comm_bytes,
        "bytes_per_step": per_step,
        "ring_factor": ring_factor(world_size),
        "time_per_step_s": t,
        "num_steps": steps,
        "total_time_s": t * steps,
    }


# ------------------------------------------------------------------------------------------
# Tensor (and sequence) parallelism
# ------------------------------------------------------------------------------------------
def tp_block_comm_bytes(
    b: int, s: int, h: int, t: int, sequence_parallel: bool = False, dtype_bytes: int = 4
) -> dict:
    """Collectives of one transformer block for one micro-batch on a tensor-parallel rank:
    ``{"forward": {kind: (count, payload_bytes_each)}, "backward": {...}}``.

    Without sequence parallelism (Megatron-LM, Shoeybi et al. 2019, §3): two all-reduces
    forward (after attention's and the MLP's row-parallel output) and two backward (the input
    gradients of the column-parallel inputs), each of the full activation ``b·s·h`` elements.
    With sequence parallelism (Korthikanti et al. 2022, §4.2.2) each all-reduce becomes an
    all-gather plus a reduce-scatter of the same payload, and backward re-gathers the saved
    sequence shard of each column-parallel input (one more all-gather per column group, 2 per
    block). ``t == 1``: nothing.
    """
    if t == 1:
        return {"forward": {}, "backward": {}}
    x = b * s * h * dtype_bytes
    if not sequence_parallel:
        return {"forward": {"all_reduce": (2, x)}, "backward": {"all_reduce": (2, x)}}
    return {
        "forward": {"all_gather": (2, x), "reduce_scatter": (2, x)},
        "backward": {"all_gather": (4, x), "reduce_scatter": (2, x)},
    }


def tp_replicated_kv_grad_bytes(
    num_layers: int, h: int, head_dim: int, kv_heads: int, t: int, dtype_bytes: int = 4
) -> int:
    """Payload of the all-reduce that sums the gradients of replicated key/value heads: when
    ``t`` exceeds ``kv_heads``, each kv head's k and v weights (``head_dim × h`` each, per layer)
    live on several ranks, and their gradients are summed over tp once per step. 0 otherwise."""
    if t <= kv_heads:
        return 0
    return kv_heads * head_dim * h * 2 * num_layers * dtype_bytes


def tp_step_comm_bytes(
    b: int,
    s: int,
    h: int,
    num_layers: int,
    t: int,
    sequence_parallel: bool = False,
    dtype_bytes: int = 4,
    replicated_grad_bytes: int = 0,
) -> dict:
    """Payload bytes per kind of collective, per rank, for one training step of llmlab's Llama
    model under tensor parallelism ``t`` (one micro-batch of ``b`` sequences of ``s`` tokens).

    * ``num_layers`` blocks of :func:`tp_block_comm_bytes`;
    * the vocab-parallel embedding sums its output (an all-reduce of ``b·s·h``; with SP a
      reduce-scatter, whose backward is an all-gather); the column-parallel LM head sums its input
      gradient in backward (an all-reduce; with SP an all-gather forward, a re-gather and a
      reduce-scatter backward);
    * the vocab-parallel cross-entropy all-reduces three fp32 values per token (the maximum
      logit, the sum of exponentials and the target logit);
    * with SP, the RMSNorm weights (2 per layer and the final norm, ``h`` each) hold partial
      gradients, summed by one fp32 all-reduce;
    * ``replicated_grad_bytes`` (e.g. :func:`tp_replicated_kv_grad_bytes`) is added to the
      all-reduce.

    Returns ``{"all_reduce", "all_gather", "reduce_scatter"}`` in bytes (the counter convention
    of :mod:`llmlab.runtime.comm`, as in ``--metrics-json``'s ``comm_bytes``).
    """
    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if t == 1:
        return out
    for phase in tp_block_comm_bytes(b, s, h, t, sequence_parallel, dtype_bytes).values():
        for kind, (n, x) in phase.items():
            out[kind] += num_layers * n * x
    x = b * s * h * dtype_bytes
    if sequence_parallel:
        out["reduce_scatter"] += 2 * x  # embedding output; LM-head input gradient
        out["all_gather"] += 3 * x  # embedding backward; LM-head input, re-gathered
        out["all_reduce"] += (2 * num_layers + 1) * h * 4  # partial norm-weight gradients
    else:
        out["all_reduce"] += 2 * x  # embedding output; LM-head input gradient
    out["all_reduce"] += 3 * b * s * 4 + replicated_grad_bytes  # vocab-parallel cross-entropy
    return out


# ------------------------------------------------------------------------------------------
# Expert and context parallelism: all-to-all payloads
# ------------------------------------------------------------------------------------------
def moe_a2a_bytes(tokens: int, hidden: int, top_k: int, bytes_per_element: int = 4) -> int:
    """Payload bytes one rank passes to the dispatch all-to-all of one MoE layer when dropless:
    ``K * N * h * bytes`` for ``N`` tokens routed to ``K`` experts each (the combine sends as many
    back; backward repeats both). Source: GShard (Lepikhin et al. 2020), §2.2-3.2."""
    return top_k * tokens * hidden * bytes_per_element


def ulysses_bytes_per_layer(
    batch: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, cp: int, dtype_bytes: int = 4
) -> dict:
    """Bytes one rank passes to all-to-all for one attention layer under DeepSpeed-Ulysses over
    ``cp`` ranks (its whole local tensors). Forward: q, k, v and out, ``B·(2H + 2H_kv)·(S/N)·D``
    elements; backward the same again. Source: Jacobs et al. 2023, §3."""
    elems = batch * (2 * num_heads + 2 * num_kv_heads) * (seq_len // cp) * head_dim
    return {"forward": elems * dtype_bytes, "backward": elems * dtype_bytes}
