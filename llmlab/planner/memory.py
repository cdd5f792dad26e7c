"""Predicted bytes on the busiest GPU of a layout: model states, activations, buffers.

* Model states: :func:`llmlab.formulas.memory.zero_model_state_bytes` of the parameters one rank
  holds. A rank holds ``L/pp`` layers, each with q/o split by tp, k/v heads ``max(kv/tp, 1)``
  (replicated when tp exceeds them, as llmlab and Megatron-LM do), the MLP split by tp, norms
  replicated; the first stage adds the vocab-parallel embedding ``V·h/tp``, the last the LM head
  (``V·h/tp``) and the final norm. Experts are split by ep. Dense states are sharded by ZeRO over
  the ``dp·cp`` ranks that reduce gradients, expert states over ``dp·cp/ep``.
* Activations: :func:`llmlab.formulas.activations.llama_block_activation_bytes` per layer and
  micro-batch of ``b`` sequences of ``seq_len/cp`` tokens, times the layers of a stage and the
  micro-batches in flight on that stage's rank (:func:`llmlab.formulas.pipeline.microbatches_in_flight`:
  1F1B's last stage holds one, interleaved's last ``((v−1)p + 1)/v``); with full
  recomputation only each layer's input is kept, plus one layer's activations while it is
  recomputed. The last stage adds the fp32 logits and their softmax, ``2·b·s·V/tp`` values.
* Buffers: ``cluster.reserved_bytes`` (CUDA context, NCCL, fragmentation), with ZeRO-3 two
  gathered layers (prefetch), with sequence parallelism one gathered ``b·s·h`` input.

The busiest rank is the larger of the first and the last pipeline stage.
"""

from __future__ import annotations

from llmlab.formulas.activations import llama_block_activation_bytes
from llmlab.formulas.memory import dtype_bytes, zero_model_state_bytes
from llmlab.formulas.pipeline import microbatches_in_flight

STATES = ("params", "grads", "optimizer_states")


def rank_params(model, lay, stage: str) -> tuple[int, int]:
    """(dense, expert) parameters on one rank of the ``"first"`` or ``"last"`` stage."""
    h, t, d = model.hidden, lay.tp, model.head_dim
    kv_per_rank = max(model.kv_heads // t, 1) if model.kv_heads >= t else 1
    attn = 2 * h * h // t + 2 * h * d * kv_per_rank
    layer = attn + model.dense_mlp_params() // t + 2 * h + h * model.num_experts
    layers = model.num_layers // lay.pp
    dense = layers * layer
    first, last = stage == "first" or lay.pp == 1, stage == "last" or lay.pp == 1
    emb = model.vocab * h // t
    dense += emb if first else 0
    dense += (0 if model.tied and first else emb) + h if last else 0
    expert = layers * model.expert_params() // lay.ep
    return dense, expert


def model_state_bytes(model, lay, workload, stage: str) -> dict:
    dense, expert = rank_params(model, lay, stage)
    dpcp = lay.dp * lay.cp
    out = zero_model_state_bytes(dense, lay.zero, dpcp, workload.dtype, workload.optimizer)
    if expert:
        ex = zero_model_state_bytes(expert, lay.zero, dpcp // lay.ep, workload.dtype, workload.optimizer)
        out = {k: out[k] + ex[k] for k in out}
    return out


def activation_bytes(model, lay, workload, stage: str) -> tuple[int, int]:
    """(peak bytes saved for backward on one rank of ``stage``, of which the one layer being
    recomputed: its tensors are saved inside backward, where llmlab's ``SavedActivations``
    does not look)."""
    db = dtype_bytes(workload.dtype)
    b = workload.global_batch_size // (lay.dp * lay.num_microbatches)
    s = workload.seq_len // lay.cp
    f = model.top_k * model.moe_ffn if model.num_experts else model.ffn
    one = llama_block_activation_bytes(b, s, model.hidden, f, model.heads, lay.tp, lay.sequence_parallel, db)
    rank = lay.pp - 1 if stage == "last" else 0
    inflight = microbatches_in_flight(lay.schedule, lay.pp, lay.num_microbatches, lay.virtual_stages, rank)
    layers = model.num_layers // lay.pp
    if lay.recompute == "full":
        kept = b * s * model.hidden * db // (lay.tp if lay.sequence_parallel else 1)
        act = layers * inflight * kept + one
        transient = one
    else:
        transient = 0
        act = layers * inflight * one
    if stage == "last" or lay.pp == 1:
        act += 2 * b * s * model.vocab // lay.tp * 4
    return round(act), transient


def buffer_bytes(model, lay, workload, cluster) -> int:
    db = dtype_bytes(workload.dtype)
    out = cluster.reserved_bytes
    if lay.zero == 3:
        out += 2 * model.layer_params() * db // lay.tp
    if lay.sequence_parallel:
        b = workload.global_batch_size // (lay.dp * lay.num_microbatches)
        out += b * workload.seq_len // lay.cp * model.hidden * db
    return round(out)


def memory_per_gpu(model, lay, workload, cluster) -> dict:
    """Bytes on the busiest GPU: ``{"params", "grads", "optimizer_states", "model_states",
    "activations", "recompute_transient", "buffers", "total", "stage"}`` (stage: which pipeline stage is busiest)."""
    best = None
    for stage in ("first", "last") if lay.pp > 1 else ("first",):
        ms = model_state_bytes(model, lay, workload, stage)
        act, transient = activation_bytes(model, lay, workload, stage)
        rec = {k: ms[k] for k in STATES} | {
            "model_states": ms["total"],
            "activations": act,
            "recompute_transient": transient,
        }
        rec["buffers"] = buffer_bytes(model, lay, workload, cluster)
        rec["total"] = rec["model_states"] + act + rec["buffers"]
        rec["stage"] = stage
        if best is None or rec["total"] > best["total"]:
            best = rec
    if best is None:  # the first stage is always checked
        raise RuntimeError("memory_per_gpu: no pipeline stage checked")
    return best
