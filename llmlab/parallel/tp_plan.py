"""The tensor-parallel plan: module name -> how it is split, applied by one function.

:data:`TP_PLAN` maps module names (fnmatch patterns) to a style, as in picotron and torchtitan;
:func:`apply_plan` replaces each matching module by its parallel form from
:mod:`llmlab.parallel.tensor_parallel` and :func:`apply_tensor_parallel` shards a whole, seeded
:class:`~llmlab.model.llama.LlamaForCausalLM` in place: it sets the model's data hooks, marks
replicated parameters and appends the gradient finalizers (:mod:`llmlab.parallel.records`) (:class:`SumOverTP` for the partial
gradients under sequence parallelism, :class:`SumOverKVReplicas` for replicated kv heads).

Sources: Shoeybi et al. 2019, "Megatron-LM", §3; Korthikanti et al. 2022, §4.2.2 (see
:mod:`llmlab.parallel.tensor_parallel` for the layers themselves).
"""

from __future__ import annotations

import torch
from torch import nn

from llmlab.model.layers import MLP, RMSNorm
from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM
from llmlab.parallel.configs import TensorParallelConfig
from llmlab.parallel.grad_reduce import all_reduce_sum_
from llmlab.parallel.records import model_record, param_record
from llmlab.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelEmbedding,
    _tp_rank,
    check_shardable,
    vocab_parallel_cross_entropy,
)
from llmlab.runtime import comm
from llmlab.runtime.mesh import Mesh
from llmlab.runtime.comm import Group
from torch.nn import Parameter
from typing import Any, Callable


def _grad(p: Parameter) -> torch.Tensor | None:
    return p.grad


class SumOverTP:
    """Grad finalizer: all-reduce (sum) the gradients of ``params`` over the tp group, in one
    flat buffer (norm weights and row-parallel biases under SP hold partial gradients).

    Finalizers are called with ``grad_of(p)``: the gradient tensor of ``p`` this rank holds
    (default ``p.grad``; under ZeRO the part of ``p`` in this rank's gradient shard, laid out
    identically on every tp rank, so the buffers still line up)."""

    def __init__(self, params: list[nn.Parameter], group: Group) -> None:
        self.params, self.group = params, group

    def __call__(self, grad_of: Callable[[Parameter], torch.Tensor | None] = _grad) -> None:
        grads = [g for g in map(grad_of, self.params) if g is not None and g.numel()]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_sum_(flat, self.group)  # partial gradients: fp16 summed in fp32
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


class SumOverKVReplicas:
    """Grad finalizer: replicated kv heads sum their weight gradients over the ranks sharing them.

    One all-reduce over the tp group of a ``[num_kv_heads, n]`` buffer in which each rank fills
    the row of its kv head: row ``j`` becomes the sum over kv head ``j``'s replicas.
    """

    def __init__(self, attns: list["ParallelAttention"], group: Group) -> None:
        self.attns, self.group = attns, group

    def __call__(self, grad_of: Callable[[Parameter], torch.Tensor | None] = _grad) -> None:
        params = [p for a in self.attns for m in (a.k_proj, a.v_proj) for p in m.split_parameters()]
        grads = [g for g in map(grad_of, params) if g is not None and g.numel()]
        if not grads:
            return
        a0 = self.attns[0]
        buf = grads[0].new_zeros(a0.kv_num_shards, sum(g.numel() for g in grads))
        buf[a0.kv_shard] = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_sum_(buf, self.group)
        for g, part in zip(grads, buf[a0.kv_shard].split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


class VocabParallelLoss:
    """The model's ``loss_function`` under TP: :func:`vocab_parallel_cross_entropy` of this rank's
    vocabulary slice (``logits [*, V/tp]``, ``labels [*]``) -> the same scalar on every tp rank."""

    def __init__(self, group: Group, vocab_start: int) -> None:
        self.group, self.vocab_start = group, vocab_start

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.group, self.vocab_start)


def _mark_duplicates(model: nn.Module, attns: list[ParallelAttention], group: Group) -> None:
    """Set every parameter's ``tp_duplicate`` (:class:`~llmlab.parallel.records.ParamRecord`): ``True`` where another tp rank holds the same
    values (replicated norms, biases and experts on tp ranks > 0; a replicated kv head on all but
    its first rank), so the global gradient norm counts each element once."""
    r = _tp_rank(group)
    sharded = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))
    }
    sharded |= {
        id(m.bias) for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.bias is not None
    }
    for p in model.parameters():
        param_record(p).tp_duplicate = id(p) not in sharded and r > 0
    for a in attns:
        if a.kv_replicated:
            first = r % (comm.group_size(group) // a.kv_num_shards) == 0
            for p in (*a.k_proj.split_parameters(), *a.v_proj.split_parameters()):
                param_record(p).tp_duplicate = not first


# The plan: module name (fnmatch pattern) -> how that module is split over the tp group.
# Attention and the dense MLP are planned as blocks so that q/k/v (and gate/up) share one
# communication region (Megatron's fused QKV): inside them q/k/v and gate/up are
# column-parallel, o_proj and down_proj row-parallel.
TP_PLAN: dict[str, str] = {
    "model.embed_tokens": "vocab_parallel",  # VocabParallelEmbedding: rows of the vocabulary
    "model.layers.*.self_attn": "attention",  # ParallelAttention: q/k/v column, o row
    "model.layers.*.mlp": "mlp",  # ParallelMLP: gate/up column, down row (dense MLPs)
    "lm_head": "column_parallel",  # logits [B, T, V/tp] for the vocab-parallel loss
}


def _vocab_parallel(m: Any, group: Group, sp: bool) -> nn.Module:
    return VocabParallelEmbedding.from_embedding(m, group, sp)


def _attention(m: Any, group: Group, sp: bool) -> nn.Module:
    return ParallelAttention(m, group, sp)


def _mlp(m: Any, group: Group, sp: bool) -> nn.Module:
    return ParallelMLP(m, group, sp) if isinstance(m, MLP) else m  # MoE: experts replicated


def _column_parallel(m: Any, group: Group, sp: bool) -> nn.Module:
    return ColumnParallelLinear.from_linear(m, group, sequence_parallel=sp)


STYLES = {
    "vocab_parallel": _vocab_parallel,
    "attention": _attention,
    "mlp": _mlp,
    "column_parallel": _column_parallel,
}


def apply_plan(model: nn.Module, plan: dict[str, str], group: Group, sequence_parallel: bool) -> None:
    """Replace every module whose name matches a pattern of ``plan`` by its parallel form
    (:data:`STYLES`), in place. The parallel modules copy this rank's slice of the full weights."""
    import fnmatch

    for name, module in list(model.named_modules()):
        style = next((st for pat, st in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, STYLES[style](module, group, sequence_parallel))


def apply_tensor_parallel(
    model: LlamaForCausalLM, mesh: Mesh, sequence_parallel: bool = False, plan: dict[str, str] | None = None
) -> LlamaForCausalLM:
    """Shard a full, seeded model over ``mesh.groups["tp"]`` in place with ``plan`` (default
    :data:`TP_PLAN`) and return it.

    Sets the model's data hooks: ``loss_function`` (:class:`VocabParallelLoss`),
    ``sequence_shards`` (``tp`` under SP: RoPE needs the full length); records every parameter's
    ``tp_duplicate`` (and ``sequence_parallel`` for the SP norm weights) and appends the gradient
    finalizers (SP norm weights; replicated kv heads) to the model's ``grad_finalizers``
    (:mod:`llmlab.parallel.records`). Raises ``ValueError`` naming the constraint
    when ``tp`` does not divide the model's dimensions.
    """
    group, tp = mesh.groups.get("tp"), mesh.size("tp")
    mc = model.config
    check_shardable(mc, tp, sequence_parallel)
    finalizers = model_record(model).grad_finalizers
    if tp == 1:
        return model
    sp = sequence_parallel
    apply_plan(model, TP_PLAN if plan is None else plan, group, sp)
    if mc.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    attns = [m for m in model.modules() if isinstance(m, ParallelAttention)]
    if sp:
        norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
        for p in norms:
            param_record(p).sequence_parallel = True
        sp_params = norms + [
            p
            for m in model.modules()
            if isinstance(m, RowParallelLinear)
            for p in m.parameters()
            if param_record(p).sequence_parallel
        ]
        finalizers.append(SumOverTP(sp_params, group))
        model.sequence_shards = tp  # hidden is [B, T/tp, h]: RoPE needs the full length T
    if attns and attns[0].kv_replicated:
        finalizers.append(SumOverKVReplicas(attns, group))
    _mark_duplicates(model, attns, group)
    model.loss_function = VocabParallelLoss(group, model.model.embed_tokens.vocab_start)  # type: ignore[assignment, arg-type]
    return model


# --------------------------------------------------------------------------------------------
# The strategy's contract (llmlab.parallel.protocols)
# --------------------------------------------------------------------------------------------
def validate(config: TensorParallelConfig, mesh: Mesh, model_config: ModelConfig) -> None:
    """Raise ``ValueError`` naming the constraint when ``mesh.tp`` ranks cannot shard
    ``model_config`` (heads, kv heads, FFN width, vocabulary; the sequence under sequence
    parallelism): :func:`~llmlab.parallel.tensor_parallel.check_shardable`."""
    check_shardable(model_config, mesh.tp, config.sequence_parallel, config.seq_len)


def apply(model: LlamaForCausalLM, mesh: Mesh, config: TensorParallelConfig) -> LlamaForCausalLM:
    """This rank's tensor-parallel shard of ``model`` (:func:`apply_tensor_parallel` with
    :data:`TP_PLAN`); ``model`` itself when ``mesh.tp`` is 1."""
    if mesh.tp == 1:
        return model
    return apply_tensor_parallel(model, mesh, sequence_parallel=config.sequence_parallel)
