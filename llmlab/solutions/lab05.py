"""Lab 05 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.runtime import comm


def shard_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """Lab 05. ZeRO partitioning: the ``[start, end)`` elements of a flat buffer of ``numel`` that
    ``rank`` owns when it is padded to a multiple of ``world`` and cut into equal shards
    (Rajbhandari et al. 2020, §5). The last shards may be shorter (or empty) once clipped to
    ``numel``."""
    per = -(-numel // world)
    start = min(rank * per, numel)
    return start, min(start + per, numel)


def zero2_grad_shard(flat_grad: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Lab 05. The ZeRO-2 gradient step, on real ranks (Rajbhandari et al. 2020, §5.2).

    ``flat_grad [numel]``: this rank's gradient of its own micro-batch, flattened (fp32). Pad it
    with zeros to a multiple of ``world``, reduce-scatter it (``comm.reduce_scatter_tensor``, a
    sum over the ``world`` data-parallel ranks) and divide by ``world``: return this rank's shard of
    the *averaged* gradient, elements ``shard_range(numel, world, rank)`` of it (shape
    ``[end - start]``; the padding is dropped). Each rank keeps only 1/world of the gradients, and
    sends and receives (world-1)/world of the flat buffer instead of an all-reduce's 2(world-1)/world.
    """
    numel = flat_grad.numel()
    per = -(-numel // world)
    padded = F.pad(flat_grad, (0, per * world - numel))
    out = torch.empty(per, dtype=flat_grad.dtype)
    comm.reduce_scatter_tensor(out, padded)
    out /= world
    start, end = shard_range(numel, world, rank)
    return out[: end - start]


def zero1_update(
    flat_param: torch.Tensor, grad_shard: torch.Tensor, rank: int, world: int, lr: float
) -> torch.Tensor:
    """Lab 05. The ZeRO-1/2 parameter update, on real ranks (Rajbhandari et al. 2020, §5.1, §7.2.1).

    ``flat_param [numel]``: the full flat parameters (identical on every rank); ``grad_shard``:
    this rank's averaged gradient shard, elements ``shard_range(numel, world, rank)`` (what
    ``zero2_grad_shard`` returns). The optimizer state lives only for the owned shard, so each rank
    updates only its shard, here with plain SGD (``p - lr * g``), then all ranks all-gather the
    updated shards (``comm.all_gather_into_tensor``, padded to a multiple of ``world``). Return the
    full updated parameters ``[numel]``, the same on every rank. Communication: Ψ for the
    all-gather, so with the reduce-scatter a step costs 2Ψ, as much as DDP's all-reduce (§7.2.1).
    """
    numel = flat_param.numel()
    per = -(-numel // world)
    start, end = shard_range(numel, world, rank)
    mine = torch.zeros(per, dtype=flat_param.dtype)
    mine[: end - start] = flat_param[start:end] - lr * grad_shard
    full = torch.empty(per * world, dtype=flat_param.dtype)
    comm.all_gather_into_tensor(full, mine)
    return full[:numel]


EXERCISES = [shard_range, zero2_grad_shard, zero1_update]
