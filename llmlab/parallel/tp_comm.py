"""The conjugate communication operators of tensor and sequence parallelism, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, §3, Fig. 3) writes a tensor-parallel MLP as ``f -> matmuls -> g``
where ``f`` is the identity forward and an all-reduce backward, and ``g`` is the reverse. Megatron
core names every such operator after the region it moves a tensor into; the names are kept here:

=============================================  =========================  =========================
operator                                        forward                    backward
=============================================  =========================  =========================
``copy_to_tensor_model_parallel_region``        identity (``f``)           all-reduce
``reduce_from_tensor_model_parallel_region``    all-reduce (``g``)         identity
``scatter_to_tensor_model_parallel_region``     keep my slice of dim -1    all-gather dim -1
``gather_from_tensor_model_parallel_region``    all-gather dim -1          keep my slice of dim -1
``scatter_to_sequence_parallel_region``         keep my slice of dim 1     all-gather dim 1
``gather_from_sequence_parallel_region``        all-gather dim 1           reduce-scatter dim 1
``reduce_scatter_to_sequence_parallel_region``  reduce-scatter dim 1       all-gather dim 1
=============================================  =========================  =========================

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4.2.2) replaces each ``f`` by ``gather_from_sequence_parallel_region`` and
each ``g`` by ``reduce_scatter_to_sequence_parallel_region``: an all-reduce *is* a reduce-scatter
followed by an all-gather, so the bytes moved are the same, but between them the activations
(norms, residuals, dropout) live sharded along the sequence.

Hidden states here are ``[B, T, h]`` (batch first, unlike Megatron's ``[T, B, h]``), so the
sequence dimension is 1; the vocabulary/feature dimension is the last one. Every collective goes
through :mod:`llmlab.runtime.comm`, so its bytes are counted. The backward sums of partial
gradients follow :mod:`llmlab.parallel.grad_reduce`: in fp16 they run in fp32 (twice the bytes),
so they overflow only where the gradient itself does. ``group`` is a tensor-parallel
process group (``mesh.groups["tp"]``); ``None`` means a single rank, and every operator is then the
identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmlab.parallel.grad_reduce import all_reduce_sum_, reduce_scatter_sum
from llmlab.runtime import comm
from llmlab.runtime.comm import Group
from typing import Any
from torch import Tensor


def _rank(group: Group) -> int:
    return dist.get_rank(group) if comm.group_size(group) > 1 else 0


def split_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous ``1/tp`` slice of ``x`` along ``dim``. Raises ``ValueError`` if
    the group size does not divide ``x.shape[dim]``."""
    n = comm.group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"tp={n} must divide dimension {dim} of size {x.shape[dim]}")
    return x.chunk(n, dim=dim)[_rank(group)].contiguous()


def gather_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (one all-gather; bytes = gathered output)."""
    n = comm.group_size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((n * moved.shape[0],) + tuple(moved.shape[1:]))
    comm.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Group, grad: bool = False) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's ``1/tp`` slice along ``dim`` (bytes = input).
    ``grad=True``: ``x`` holds partial gradients, summed by
    :func:`~llmlab.parallel.grad_reduce.reduce_scatter_sum` (fp16 in fp32)."""
    n = comm.group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"tp={n} must divide dimension {dim} of size {x.shape[dim]}")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n,) + tuple(moved.shape[1:]))
    if grad:
        reduce_scatter_sum(out, moved, group)
    else:
        comm.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def all_reduce(x: torch.Tensor, group: Group, grad: bool = False) -> torch.Tensor:
    """Sum ``x`` over ranks (a new tensor; the input is left untouched). ``grad=True``: ``x``
    holds partial gradients, summed by :func:`~llmlab.parallel.grad_reduce.all_reduce_sum_`
    (fp16 in fp32, so the sum overflows only where the gradient itself does)."""
    if comm.group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    if grad:
        all_reduce_sum_(out, group)
    else:
        comm.all_reduce(out, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Any:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        return all_reduce(g, ctx.group, grad=True), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Any:
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, dim: int) -> Any:
        ctx.group, ctx.dim = group, dim
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        return gather_along(g, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, dim: int) -> Any:
        ctx.group, ctx.dim = group, dim
        return gather_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        return split_along(g, ctx.dim, ctx.group), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Any:
        ctx.group = group
        return gather_along(x, 1, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        return reduce_scatter_along(g, 1, ctx.group, grad=True), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Any:
        ctx.group = group
        return reduce_scatter_along(x, 1, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:
        return gather_along(g, 1, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward. ``[*] -> [*]``."""
    out: torch.Tensor = _CopyToRegion.apply(x, group)
    return out


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``g``: all-reduce forward (partial sums -> full), identity backward. ``[*] -> [*]``."""
    out: torch.Tensor = _ReduceFromRegion.apply(x, group)
    return out


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dim: ``[..., n] -> [..., n/tp]``; backward all-gathers."""
    out: torch.Tensor = _ScatterToRegion.apply(x, group, -1)
    return out


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the last dim: ``[..., n/tp] -> [..., n]``; backward keeps this rank's slice."""
    out: torch.Tensor = _GatherFromRegion.apply(x, group, -1)
    return out


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's sequence slice: ``[B, T, h] -> [B, T/tp, h]``; backward all-gathers."""
    out: torch.Tensor = _ScatterToRegion.apply(x, group, 1)
    return out


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the sequence: ``[B, T/tp, h] -> [B, T, h]``; backward reduce-scatters
    (the gradient of a replicated input is the sum of every rank's contribution)."""
    out: torch.Tensor = _GatherFromSequenceRegion.apply(x, group)
    return out


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence slice: ``[B, T, h] -> [B, T/tp, h]``;
    backward all-gathers."""
    out: torch.Tensor = _ReduceScatterToSequenceRegion.apply(x, group)
    return out
