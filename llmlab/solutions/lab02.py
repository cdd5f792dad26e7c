"""Lab 02 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def row_parallel_forward(
    x_shard: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None, group=None
) -> torch.Tensor:
    """Lab 02. ``RowParallelLinear.forward`` (Megatron-LM, Shoeybi et al. 2019, §3).

    ``x_shard [B, in/tp]`` is this rank's slice of the input features, ``w_shard [out, in/tp]`` the
    matching columns of the weight; return the full ``y = x @ W.T + bias`` ``[B, out]`` on every
    rank: a partial product, an all-reduce (sum) over ``group``, and the bias added once.
    """
    y = x_shard @ w_shard.t()
    dist.all_reduce(y, group=group)
    return y if bias is None else y + bias


def column_parallel_forward(
    x: torch.Tensor, w_shard: torch.Tensor, b_shard: torch.Tensor | None, gather_output: bool, group=None
) -> torch.Tensor:
    """Lab 02. ``ColumnParallelLinear.forward`` (Megatron-LM, Shoeybi et al. 2019, §3).

    ``x [B, in]`` is the full input (the same on every rank); ``w_shard [out/tp, in]`` is this
    rank's block of rows of the weight ``W [out, in]`` (rank ``r`` holds output features
    ``r·out/tp .. (r+1)·out/tp - 1``) and ``b_shard [out/tp]`` the matching bias. Return this rank's
    slice of ``y = x @ W.T + b``, ``[B, out/tp]``, with no communication; with ``gather_output``,
    all-gather the slices over ``group`` and return the full ``[B, out]`` on every rank, features
    in rank order.
    """
    y = x @ w_shard.t()
    if b_shard is not None:
        y = y + b_shard
    if not gather_output:
        return y
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, target: torch.Tensor, vocab_start: int, group=None
) -> torch.Tensor:
    """Lab 02. Cross-entropy from vocabulary-parallel logits, never gathering ``[T, V]``
    (Megatron-LM, Shoeybi et al. 2019, §3: the output GEMM fused with the loss).

    ``logits_shard [T, V/tp]``: this rank's slice of the logits, vocabulary ids ``vocab_start ..
    vocab_start + V/tp - 1``; ``target [T]`` int64 ids over the whole vocabulary. Return the loss of
    every token, ``[T]``, equal on every rank to ``F.cross_entropy(full_logits, target,
    reduction="none")``: (1) the max logit of each token over the whole vocabulary, an all-reduce
    with ``ReduceOp.MAX``; (2) the sum of ``exp(logit - max)``, an all-reduce (sum); (3) the target's
    shifted logit, taken on the one rank whose slice holds the target (0 on the others: mask it),
    an all-reduce (sum). Loss = ``log(sum_exp) - target_logit``.
    """
    m = logits_shard.max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits_shard - m.unsqueeze(-1)
    sum_exp = shifted.exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    local = target - vocab_start
    mine = (local >= 0) & (local < logits_shard.shape[-1])
    t = shifted.gather(-1, local.clamp(0, logits_shard.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    t = torch.where(mine, t, torch.zeros_like(t))
    dist.all_reduce(t, group=group)
    return sum_exp.log() - t


EXERCISES = [row_parallel_forward, column_parallel_forward, vocab_parallel_cross_entropy]
