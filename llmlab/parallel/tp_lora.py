"""LoRA adapters on a tensor-parallel model (Hu et al. 2021 on Megatron's layers, as NeMo/Megatron's
LoRA under TP): each adapter is split the way its base layer is.

* Column-parallel base (``q/k/v``, ``gate/up``: output features split): ``A [r, in]`` replicated,
  ``B [out/tp, r]`` this rank's rows, the same rows as its base weight (``k``/``v`` under GQA: the
  rows of this rank's kv head, replicated like it). ``A x`` is computed in the base's communication
  region (:func:`~llmlab.parallel.tensor_parallel.column_parallel_linears`), so the forward adds no
  collective. ``A``'s gradient is ``sum_t dz_t x_t^T`` with ``dz = dY_shard B_shard``: partial on
  each rank (its ``B`` rows), so it is summed over the tp group after backward.
* Row-parallel base (``o``, ``down``: input features split): ``A [r, in/tp]`` this rank's columns,
  ``B [out, r]`` replicated. ``x_shard A_shard^T`` is a partial sum like the base's output and is
  reduced in the *same* collective (one ``[*, out + r]`` all-reduce, or reduce-scatter under SP),
  then ``B`` applies to the whole ``[*, r]``: the sum is exact (the same partial products as the
  base's), and the adapter adds ``r`` columns to an existing collective instead of a second one.
  Under sequence parallelism ``B`` sees only this rank's tokens: its gradient is partial and summed
  over tp after backward, like a row-parallel bias.

Why not split ``A`` of a column layer by its rank dimension (NeMo's default): ``r`` is small (4-64)
and rarely divisible by tp, and a replicated ``A`` needs no gather of ``[*, r]`` activations; the
price is one all-reduce of ``r x in`` gradient elements per column layer and step, batched with the
others in one flat buffer. The initial ``A`` is the one-rank ``A`` (:func:`~llmlab.model.lora.
init_lora_A`, seeded by name) cut like the base, and ``B = 0``, so the tensor-parallel run trains
exactly the one-rank adapters; the checkpoint (and ``--save-model``'s PEFT adapter) assembles the
full ``A``/``B`` from the slices because their full shapes are recorded
(:func:`~llmlab.model.lora.adapter_shapes`).
"""

from __future__ import annotations

import torch
from torch import nn

from llmlab.model.lora import init_lora_A, is_target
from llmlab.parallel.records import model_record, param_record
from llmlab.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    RowParallelLinear,
    _tp_rank,
)
from llmlab.parallel.tp_plan import SumOverTP
from llmlab.runtime import comm
from llmlab.runtime.comm import Group


def _linear(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` without bias holding ``weight [out, in]`` (PEFT's ``lora_A``/``lora_B``)."""
    m = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    m.weight.data.copy_(weight)
    return m


def _weight(m: nn.Linear | None) -> nn.Parameter:
    assert m is not None and isinstance(m.weight, nn.Parameter)
    return m.weight


def _attach(module: nn.Module, name: str, rank: int, alpha: float, seed: int, group: Group) -> None:
    """Give a column- or row-parallel ``module`` (full-model name ``name``) its adapter slices."""
    assert isinstance(module, (ColumnParallelLinear, RowParallelLinear))
    full_a = init_lora_A(name, module.in_features, rank, seed).to(module.weight.device)
    r, tp = _tp_rank(group), comm.group_size(group)
    duplicate = r > 0  # the replicated half: the gradient norm counts it once
    if isinstance(module, ColumnParallelLinear):
        a, b = full_a, module.weight.new_zeros(module.weight.shape[0], rank)
        module.lora_A, module.lora_B = _linear(a), _linear(b)
        param_record(_weight(module.lora_A)).tp_duplicate = duplicate
    else:
        a, b = full_a.chunk(tp, 1)[r], module.weight.new_zeros(module.out_features, rank)
        module.lora_A, module.lora_B = _linear(a), _linear(b)
        param_record(_weight(module.lora_B)).tp_duplicate = duplicate
        param_record(_weight(module.lora_B)).sequence_parallel = module.sequence_parallel
    module.lora_scaling = alpha / rank


def _partial_params(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters with partial gradients on each tp rank: every column-parallel
    ``lora_A`` (this rank's ``B`` rows) and, under SP, every row-parallel ``lora_B``."""
    out = []
    for m in model.modules():
        if isinstance(m, ColumnParallelLinear) and m.lora_A is not None:
            out.append(_weight(m.lora_A))
        if isinstance(m, RowParallelLinear) and m.lora_B is not None:
            if param_record(_weight(m.lora_B)).sequence_parallel:
                out.append(_weight(m.lora_B))
    return out


def _mark_kv_replicas(model: nn.Module, group: Group) -> None:
    """A replicated kv head's ``B`` rows: a duplicate on all but the head's first rank (its
    gradient is summed over the replicas by the model's ``SumOverKVReplicas``)."""
    tp, r = comm.group_size(group), _tp_rank(group)
    for a in model.modules():
        if isinstance(a, ParallelAttention) and a.kv_replicated:
            for m in (a.k_proj, a.v_proj):
                if m.lora_B is not None:
                    param_record(_weight(m.lora_B)).tp_duplicate = r % (tp // a.kv_num_shards) != 0


@torch.no_grad()
def apply_lora(
    model: nn.Module, targets: list[str], rank: int, alpha: float, seed: int, group: Group
) -> list[str]:
    """Add LoRA adapters (rank ``rank``, scale ``alpha / rank``) to every column- or row-parallel
    layer named ``*.<target>`` of tensor-parallel ``model`` (see the module docstring for the
    split), freeze every other parameter, record the replicated halves and append the gradient
    finalizer summing the partial adapter gradients over ``group``. Returns the adapted modules'
    names. Raises ``ValueError`` when no layer matches ``targets``."""
    for p in model.parameters():
        p.requires_grad_(False)
    done = []
    for name, module in list(model.named_modules()):
        if is_target(name, targets) and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            _attach(module, name, rank, alpha, seed, group)
            done.append(name)
    if not done:
        raise ValueError(f"--lora-target {','.join(targets)}: no such linear layer in the model")
    _mark_kv_replicas(model, group)
    model_record(model).grad_finalizers.append(SumOverTP(_partial_params(model), group))
    return done
