"""Lab 02 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def row_parallel_forward(x_shard: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None,
                         group=None) -> torch.Tensor:
    """Lab 02. ``RowParallelLinear.forward`` (Megatron-LM, Shoeybi et al. 2019, §3).

    ``x_shard [B, in/tp]`` is this rank's slice of the input features, ``w_shard [out, in/tp]`` the
    matching columns of the weight; return the full ``y = x @ W.T + bias`` ``[B, out]`` on every
    rank: a partial product, an all-reduce (sum) over ``group``, and the bias added once.
    """
    y = x_shard @ w_shard.t()
    dist.all_reduce(y, group=group)
    return y if bias is None else y + bias


EXERCISES = [row_parallel_forward]
