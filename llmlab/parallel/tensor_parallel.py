"""Tensor parallelism (Megatron-LM) with optional sequence parallelism.

Sources: Shoeybi et al. 2019, "Megatron-LM", §3 (column- then row-parallel linear pairs, one
all-reduce forward and one backward per pair, vocab-parallel embedding and cross-entropy);
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.2.2
(sequence parallelism: the norm regions are sharded along the sequence and each all-reduce becomes
an all-gather + reduce-scatter pair).

A linear layer ``Y = X W^T`` with ``W`` of shape ``[out, in]`` can be split two ways over ``tp``
ranks:

* :class:`ColumnParallelLinear`: each rank holds ``out/tp`` rows of ``W`` (columns of ``W^T``) and
  computes ``out/tp`` output features from the whole input. No communication forward; the input
  gradient is a sum over ranks (``copy_to_tensor_model_parallel_region``).
* :class:`RowParallelLinear`: each rank holds ``in/tp`` columns of ``W``, takes its slice of the
  input features and produces a partial sum of the whole output; one all-reduce completes it.

A transformer block is two such pairs: ``q/k/v`` (column) -> attention on ``H/tp`` heads -> ``o``
(row), and ``gate/up`` (column) -> SwiGLU -> ``down`` (row): two all-reduces forward and two
backward per block. :func:`llmlab.parallel.tp_plan.apply_tensor_parallel` turns a full, seeded
:class:`~llmlab.model.llama.LlamaForCausalLM` into this rank's shard in place with these layers
(it keeps only this rank's slices of the full weights, so the maths is the single-device maths).

GQA: with ``num_key_value_heads >= tp`` the key/value heads are split like the query heads; with
fewer key/value heads than ranks each kv head is *replicated* on ``tp/num_kv_heads`` ranks (the
ranks whose query heads use it), and the replicas' weight gradients are summed after backward.

Vocabulary: the embedding and ``lm_head`` are split along the vocabulary and the loss is computed
by :func:`vocab_parallel_cross_entropy` without ever gathering the ``[B, T, vocab]`` logits; after
the forward every tp rank holds the same full loss. ``model(ids)`` without labels returns this
rank's logits shard ``[B, T, vocab/tp]`` (gather it with
:func:`~llmlab.parallel.tp_comm.gather_from_tensor_model_parallel_region`). The vocabulary is not
padded: a degree that does not divide it is refused (:func:`check_shardable`).

Sequence parallelism: hidden states between blocks are ``[B, T/tp, h]``; the norms (and the
residual adds) run on the shard. The column-parallel matmuls all-gather their input and, as in
Korthikanti et al., save only the shard for backward, all-gathering it again to form the weight
gradient (one extra all-gather per column group in backward). Norm weights (and row-parallel
biases) then have partial gradients, summed over the tp group after backward by a
``grad_finalizers`` entry (:mod:`llmlab.parallel.records`). The model has no dropout, so there is no dropout region to shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmlab.model.context import get_context
from llmlab.model.layers import MLP
from llmlab.model.llama import Attention, apply_rotary, causal_attention
from llmlab.parallel.records import param_record
from llmlab.parallel.tp_comm import (
    copy_to_tensor_model_parallel_region,
    gather_along,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_along,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from llmlab.runtime import comm
from llmlab.runtime.comm import Group
from typing import Any, Protocol
from llmlab.model.config import ModelConfig


def _tp_rank(group: Group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if comm.group_size(group) > 1 else 0


# --------------------------------------------------------------------------------------------
# Column-parallel matmuls sharing one input (q/k/v, gate/up)
# --------------------------------------------------------------------------------------------
class _SequenceParallelColumnMatmul(torch.autograd.Function):
    """``outs_i = all_gather_seq(x) @ W_i^T + b_i`` saving only the shard ``x`` for backward.

    Backward all-gathers ``x`` again (for the weight gradients) and reduce-scatters the input
    gradient (Korthikanti et al. 2022, §4.2.2). Several weights share the gather, as Megatron's
    fused QKV matmul does; a frozen weight (LoRA's base) gets no gradient computed.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, *params: Tensor) -> Any:
        total = gather_along(x, 1, group)
        ws, bs = params[0::2], params[1::2]
        ctx.group, ctx.has_bias = group, [b is not None for b in bs]
        ctx.save_for_backward(x, *ws)
        return tuple(F.linear(total, w, b) for w, b in zip(ws, bs))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        x, *ws = ctx.saved_tensors
        total = gather_along(x, 1, ctx.group)
        flat = total.reshape(-1, total.shape[-1])
        grad_total: Tensor | None = None
        out: list[Tensor | None] = []
        for i, (g, w, has_b) in enumerate(zip(grads, ws, ctx.has_bias)):
            gi = g @ w
            grad_total = gi if grad_total is None else grad_total + gi
            g2 = g.reshape(-1, g.shape[-1])
            need_w, need_b = ctx.needs_input_grad[2 + 2 * i], ctx.needs_input_grad[3 + 2 * i]
            out += [g2.t() @ flat if need_w else None, g2.sum(0) if has_b and need_b else None]
        assert grad_total is not None
        return (reduce_scatter_along(grad_total, 1, ctx.group, grad=True), None, *out)


def column_parallel_linears(
    x: torch.Tensor, layers: list["ColumnParallelLinear"], group: Group, sequence_parallel: bool = False
) -> list[torch.Tensor]:
    """Apply several column-parallel layers to one input with one communication region.

    ``x``: ``[B, T, in]`` (``[B, T/tp, in]`` under sequence parallelism). Returns one
    ``[B, T, out_i/tp]`` tensor per layer. Without SP: one ``copy_to`` region (identity forward,
    one all-reduce of the input gradient backward); with SP: one all-gather forward, one
    all-gather + one reduce-scatter backward.

    A layer with a LoRA adapter (``lora_A [r, in]`` replicated, ``lora_B [out/tp, r]`` its rows)
    adds ``scaling * B (A x)``: ``A x`` joins the region as one more weight (the same gathered
    input, the input gradient summed with the base's), so the adapter adds no communication here;
    ``A``'s gradient is partial (this rank's rows of ``B``), summed over tp after backward
    (:func:`llmlab.parallel.tp_lora.apply_lora`). A layer serving many adapters
    (``served_lora``, :class:`ServedLoRA`; inference, no SP) adds each token's own the same way.
    """
    adapted = [layer for layer in layers if layer.lora_A is not None]
    a_weights = [layer.lora_A.weight for layer in adapted if layer.lora_A is not None]
    if sequence_parallel and comm.group_size(group) > 1:
        if any(layer.served_lora is not None for layer in layers):
            raise ValueError("served LoRA adapters need sequence_parallel=False (serving does not shard T)")
        params: list[Tensor | None] = [t for layer in layers for t in (layer.weight, layer.bias)]
        params += [t for a in a_weights for t in (a, None)]
        outs = list(_SequenceParallelColumnMatmul.apply(x, group, *params))
    else:
        x = copy_to_tensor_model_parallel_region(x, group)
        outs = [F.linear(x, layer.weight, layer.bias) for layer in layers]
        outs += [F.linear(x, a) for a in a_weights]
    low_rank = iter(outs[len(layers) :])
    ys = [
        y if layer.lora_B is None else y + layer.lora_B(next(low_rank)) * layer.lora_scaling
        for y, layer in zip(outs, layers)
    ]
    return [  # served adapters (inference): each token's own, from the whole input x
        y if (a := layer.served_lora) is None or not a.active() else a.up(a.down(x), y)
        for y, layer in zip(ys, layers)
    ]


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------
class ServedLoRA(Protocol):
    """Many LoRA adapters on one parallel layer, each token its own (the serving engine's slots,
    :mod:`llmlab.inference.lora`), split as the training adapters are (:mod:`llmlab.parallel.
    tp_lora`): ``down(x [..., in or in/tp]) -> [..., r]`` (each token's ``x A_s^T``; partial on a
    row-parallel layer, summed in its reduction), ``up(z [..., r], y) -> y + B_s z`` per token."""

    def active(self) -> bool: ...  # any token of this step has an adapter (the same on every rank)

    def down(self, x: Tensor) -> Tensor: ...

    def up(self, z: Tensor, y: Tensor) -> Tensor: ...


class ColumnParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W``'s output features split over the tp group (Megatron §3).

    Shapes: input ``[*, in_features]`` (``[B, T/tp, in]`` with ``sequence_parallel``), output
    ``[*, out_features/tp]``, or ``[*, out_features]`` with ``gather_output=True`` (one all-gather
    of the last dim). Parameters: ``weight [out/tp, in]``, ``bias [out/tp]``; with a LoRA
    adapter (:mod:`llmlab.parallel.tp_lora`) also ``lora_A.weight [r, in]`` (replicated) and
    ``lora_B.weight [out/tp, r]`` (split like ``weight``), output scaled by ``lora_scaling``.
    Build it from a full ``nn.Linear`` with :meth:`from_linear`.
    Raises ``ValueError`` if ``tp`` does not divide ``out_features``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        bias: bool = False,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        num_shards: int | None = None,
    ) -> None:
        super().__init__()
        n = num_shards or comm.group_size(group)
        if out_features % n:
            raise ValueError(f"tp={n} must divide out_features={out_features}")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features // n, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features // n)) if bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.lora_A: nn.Linear | None = None  # LoRA (llmlab.parallel.tp_lora): none by default
        self.lora_B: nn.Linear | None = None
        self.lora_scaling = 0.0
        self.served_lora: ServedLoRA | None = None  # many adapters, served (inference.lora)

    def split_parameters(self) -> list[nn.Parameter]:
        """The parameters split like the output features: ``weight``, ``bias`` and LoRA's
        ``lora_B.weight`` (not the replicated ``lora_A``)."""
        b = None if self.lora_B is None else self.lora_B.weight
        return [p for p in (self.weight, self.bias, b) if isinstance(p, nn.Parameter)]

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls,
        linear: nn.Linear,
        group: Group,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        shard: int | None = None,
        num_shards: int | None = None,
    ) -> "ColumnParallelLinear":
        """This rank's rows of ``linear.weight``: shard ``shard`` (default: tp rank) of
        ``num_shards`` (default: tp) equal row blocks."""
        n = num_shards or comm.group_size(group)
        i = _tp_rank(group) if shard is None else shard
        m = cls(
            linear.in_features,
            linear.out_features,
            group,
            linear.bias is not None,
            gather_output,
            sequence_parallel,
            num_shards=n,
        )
        m.weight.copy_(linear.weight.chunk(n, 0)[i])
        if linear.bias is not None and m.bias is not None:
            m.bias.copy_(linear.bias.chunk(n, 0)[i])
        return m.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = column_parallel_linears(x, [self], self.group, self.sequence_parallel)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W``'s input features split over the tp group (Megatron §3).

    Input ``[*, in/tp]`` when ``input_is_parallel`` (the output of a column-parallel layer), else
    ``[*, in]`` (this rank keeps its slice). Output ``[*, out]``: the partial products are summed
    with one all-reduce, or, with ``sequence_parallel``, one reduce-scatter that leaves
    ``[B, T/tp, out]``. The bias ``[out]`` is replicated and added after the reduction.
    With a LoRA adapter (:mod:`llmlab.parallel.tp_lora`): ``lora_A.weight [r, in/tp]`` (split
    like ``weight``) and ``lora_B.weight [out, r]`` (replicated); the partial ``x A^T [*, r]``
    rides in the base's reduction (one ``[*, out + r]`` collective), then ``scaling * B`` applies.
    Raises ``ValueError`` if ``tp`` does not divide ``in_features``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        bias: bool = False,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        n = comm.group_size(group)
        if in_features % n:
            raise ValueError(f"tp={n} must divide in_features={in_features}")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // n))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None and sequence_parallel:
            # partial gradient: summed over tp after backward
            param_record(self.bias).sequence_parallel = True
        self.lora_A: nn.Linear | None = None  # LoRA (llmlab.parallel.tp_lora): none by default
        self.lora_B: nn.Linear | None = None
        self.lora_scaling = 0.0
        self.served_lora: ServedLoRA | None = None  # many adapters, served (inference.lora)

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls, linear: nn.Linear, group: Group, input_is_parallel: bool = True, sequence_parallel: bool = False
    ) -> "RowParallelLinear":
        """This rank's columns of ``linear.weight`` (the bias is copied whole)."""
        m = cls(
            linear.in_features,
            linear.out_features,
            group,
            linear.bias is not None,
            input_is_parallel,
            sequence_parallel,
        )
        m.weight.copy_(linear.weight.chunk(comm.group_size(group), 1)[_tp_rank(group)])
        if linear.bias is not None and m.bias is not None:
            m.bias.copy_(linear.bias)
        return m.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        y = F.linear(x, self.weight)
        z = self._low_rank(x)
        if z is not None:  # x A^T is partial too: reduced in the same collective
            y = torch.cat([y, z], dim=-1)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.group)
        if z is None:
            return y if self.bias is None else y + self.bias
        y, z = y[..., : self.out_features], y[..., self.out_features :]
        y = y if self.bias is None else y + self.bias
        if self.lora_B is not None:
            out: Tensor = y + self.lora_B(z) * self.lora_scaling
            return out
        assert self.served_lora is not None
        return self.served_lora.up(z, y.contiguous())

    def _low_rank(self, x: torch.Tensor) -> torch.Tensor | None:
        """This rank's partial ``x A^T [*, r]`` of the LoRA adapter (or of each token's served
        adapter), ``None`` without one."""
        if self.lora_A is not None:
            return F.linear(x, self.lora_A.weight)
        if self.served_lora is None or not self.served_lora.active():
            return None
        return self.served_lora.down(x)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary (Megatron §3).

    Rank ``r`` holds rows ``[r*V/tp, (r+1)*V/tp)``; it looks up the ids it owns, writes zeros for
    the others, and the partial results are summed: ``[B, T] int64 -> [B, T, h]`` with one
    all-reduce, or ``[B, T/tp, h]`` with one reduce-scatter under ``sequence_parallel``.
    Raises ``ValueError`` if ``tp`` does not divide ``num_embeddings``.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, group: Group, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        n = comm.group_size(group)
        if num_embeddings % n:
            raise ValueError(f"tp={n} must divide vocab_size={num_embeddings}")
        self.num_embeddings, self.group, self.sequence_parallel = num_embeddings, group, sequence_parallel
        per = num_embeddings // n
        self.vocab_start, self.vocab_end = _tp_rank(group) * per, (_tp_rank(group) + 1) * per
        self.weight = nn.Parameter(torch.empty(per, embedding_dim))
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    @torch.no_grad()
    def from_embedding(
        cls, emb: nn.Embedding, group: Group, sequence_parallel: bool = False
    ) -> "VocabParallelEmbedding":
        m = cls(emb.num_embeddings, emb.embedding_dim, group, sequence_parallel)
        m.weight.copy_(emb.weight[m.vocab_start : m.vocab_end])
        return m.to(emb.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)
        return reduce_from_tensor_model_parallel_region(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocab-sharded logits (Megatron ``cross_entropy.py`` steps)."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Any, vocab_start: int, group: Group, ignore_index: int
    ) -> Any:
        # 1. global max over the vocabulary, for a stable softmax (one all-reduce of [N] floats).
        m = logits.max(dim=-1).values
        if comm.group_size(group) > 1:
            comm.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - m.unsqueeze(-1)
        # 2. the target's logit lives on exactly one rank: others contribute 0 (all-reduce).
        n = logits.shape[-1]
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < n)
        idx = local_t.clamp(0, n - 1)
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        # 3. sum of exponentials over the whole vocabulary (all-reduce).
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        both = torch.stack([target_logit, sum_exp])
        if comm.group_size(group) > 1:
            comm.all_reduce(both, group=group)
        target_logit, sum_exp = both[0], both[1]
        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit) * valid
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), idx, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        softmax, idx, onehot_here, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, idx.unsqueeze(-1), -onehot_here.to(grad.dtype).unsqueeze(-1))
        grad.mul_((g * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: Group,
    vocab_start: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over labels ``!= ignore_index`` from vocab-sharded logits.

    ``logits``: ``[*, V/tp]`` (this rank's vocabulary slice, which starts at ``vocab_start``;
    default ``tp_rank * V/tp``), ``labels``: ``[*]`` int64 over the full vocabulary. Three
    all-reduces of ``[N]`` floats (max, then target logit and sum of exponentials together); the
    ``[N, V]`` logits are never gathered. Returns the same scalar on every rank.
    """
    if vocab_start is None:
        vocab_start = _tp_rank(group) * logits.shape[-1]
    flat, tgt = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    per_token: Tensor = _VocabParallelCrossEntropy.apply(flat, tgt, vocab_start, group, ignore_index)
    return per_token.sum() / (tgt != ignore_index).sum().clamp(min=1)


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------
class ParallelAttention(nn.Module):
    """GQA self-attention on this rank's ``H/tp`` query heads and their key/value heads.

    ``forward(x [B,T,h] or [B,T/tp,h] under SP, cos, sin) -> same shape``. q/k/v are one
    column-parallel group (one communication region), ``o_proj`` is row-parallel. Parameter names
    are those of :class:`~llmlab.model.llama.Attention`; inside a serving engine's forward context
    (tensor-parallel inference) the attention itself is the context's, over this rank's heads of
    the paged KV cache, as in :class:`~llmlab.model.llama.Attention`.
    """

    def __init__(self, attn: Attention, group: Group, sequence_parallel: bool = False) -> None:
        super().__init__()
        tp, r = comm.group_size(group), _tp_rank(group)
        H, KV = attn.num_heads, attn.num_kv_heads
        self.group, self.sequence_parallel, self.head_dim = group, sequence_parallel, attn.head_dim
        self.layer_idx, self.sliding_window = attn.layer_idx, attn.sliding_window
        self.num_heads = H // tp
        self.kv_replicated = KV < tp
        self.num_kv_heads = 1 if self.kv_replicated else KV // tp
        # With fewer kv heads than ranks, rank r uses kv head r // (tp / KV) (its query heads'
        # group), held as one of KV shards.
        kv_shard, kv_n = (r // (tp // KV), KV) if self.kv_replicated else (r, tp)
        self.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, group)
        self.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, group, shard=kv_shard, num_shards=kv_n)
        self.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, group, shard=kv_shard, num_shards=kv_n)
        self.o_proj = RowParallelLinear.from_linear(attn.o_proj, group, sequence_parallel=sequence_parallel)
        self.kv_shard, self.kv_num_shards = kv_shard, kv_n

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = column_parallel_linears(
            x, [self.q_proj, self.k_proj, self.v_proj], self.group, self.sequence_parallel
        )
        B, T, D = q.shape[0], q.shape[1], self.head_dim
        q = q.view(B, T, self.num_heads, D).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, D).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, D).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        ctx = get_context()
        if ctx is not None:  # serving: the engine's attention over this rank's paged KV heads
            o = ctx.attention(
                self.layer_idx,
                q.transpose(1, 2).reshape(B * T, self.num_heads, D),
                k.transpose(1, 2).reshape(B * T, self.num_kv_heads, D),
                v.transpose(1, 2).reshape(B * T, self.num_kv_heads, D),
                self.sliding_window,
            )
            res: Tensor = self.o_proj(o.reshape(B, T, self.num_heads * D))
            return res
        out = causal_attention(self, q, k, v)  # ring/Ulysses when context parallelism set it
        res = self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * D))
        return res


class ParallelMLP(nn.Module):
    """SwiGLU MLP with ``gate/up`` column-parallel (one region) and ``down`` row-parallel.
    ``[B,T,h] -> [B,T,h]`` (``[B,T/tp,h]`` in and out under SP); ``ffn/tp`` features per rank."""

    def __init__(self, mlp: MLP, group: Group, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, group)
        self.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, group)
        self.down_proj = RowParallelLinear.from_linear(
            mlp.down_proj, group, sequence_parallel=sequence_parallel
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_parallel_linears(
            x, [self.gate_proj, self.up_proj], self.group, self.sequence_parallel
        )
        out: Tensor = self.down_proj(F.silu(gate) * up)
        return out


# --------------------------------------------------------------------------------------------
# Which degrees can shard a model
# --------------------------------------------------------------------------------------------
def check_shardable(
    mc: ModelConfig, tp: int, sequence_parallel: bool = False, seq_len: int | None = None, name: str = "tp"
) -> None:
    """Raise ``ValueError`` naming the constraint when ``tp`` ranks cannot shard model config
    ``mc`` (heads, kv heads, FFN width, vocabulary; ``seq_len`` under sequence parallelism);
    ``name`` is the degree's name in the message (``tensor_parallel_size`` for inference)."""
    if sequence_parallel and tp == 1:
        raise ValueError(
            "--sequence-parallel needs --tp > 1 (it shards the sequence over the tensor-parallel ranks)"
        )
    if tp == 1:
        return
    H, KV = mc.num_attention_heads, mc.num_key_value_heads
    if H % tp:
        raise ValueError(f"{name}={tp} must divide num_attention_heads={H}")
    if KV >= tp and KV % tp:
        raise ValueError(f"{name}={tp} must divide num_key_value_heads={KV}")
    if KV < tp and tp % KV:
        raise ValueError(
            f"{name}={tp} must be a multiple of num_key_value_heads={KV} when it exceeds "
            f"it (each kv head is replicated on tp/num_key_value_heads ranks)"
        )
    if not mc.num_experts and mc.intermediate_size % tp:
        raise ValueError(f"{name}={tp} must divide intermediate_size={mc.intermediate_size}")
    if mc.vocab_size % tp:
        raise ValueError(
            f"{name}={tp} must divide vocab_size={mc.vocab_size} (the vocabulary is "
            f"split over {name} ranks and not padded)"
        )
    if sequence_parallel:
        if seq_len is not None and seq_len % tp:
            raise ValueError(
                f"tp={tp} must divide --seq-len {seq_len} (sequence parallelism shards the sequence)"
            )
        if mc.num_experts:
            raise ValueError(
                "--sequence-parallel with a mixture-of-experts model is not "
                "supported (the MoE layer would see a sequence shard)"
            )
