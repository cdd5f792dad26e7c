"""Lab 01 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def ring_reduce_scatter(chunks: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
    """Lab 01. The reduce-scatter phase of ring all-reduce, with ``dist.send``/``dist.recv`` only.

    ``chunks``: this rank's tensor split into ``world`` equal chunks. In step ``s`` (0..world-2)
    rank ``r`` sends its running chunk ``(r - s) % world`` to rank ``r+1`` and adds what it receives
    from rank ``r-1`` into its chunk ``(r - s - 1) % world``. Return the fully reduced chunk
    ``(rank + 1) % world`` (the sum of that chunk over all ranks). Each rank sends
    (world-1)/world of the tensor.
    """
    chunks = [c.clone() for c in chunks]
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        send_idx, recv_idx = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(chunks[recv_idx])
        if rank % 2 == 0:  # even ranks send first, odd ranks receive first: no deadlock
            dist.send(chunks[send_idx], right)
            dist.recv(buf, left)
        else:
            dist.recv(buf, left)
            dist.send(chunks[send_idx], right)
        chunks[recv_idx] += buf
    return chunks[(rank + 1) % world]


EXERCISES = [ring_reduce_scatter]
