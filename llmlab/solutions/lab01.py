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


def ring_all_gather(chunks: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
    """Lab 01. The all-gather phase of ring all-reduce, with ``dist.send``/``dist.recv`` only.

    ``chunks``: this rank's ``world`` equal chunks after the reduce-scatter: only chunk
    ``(rank + 1) % world`` holds the fully reduced sum, the others are stale. In step ``s``
    (0..world-2) rank ``r`` sends chunk ``(r + 1 - s) % world`` to rank ``r+1`` and *overwrites* its
    chunk ``(r - s) % world`` with what it receives from rank ``r-1``. Return the whole reduced
    tensor, ``torch.cat`` of the chunks (same on every rank). Each rank sends (world-1)/world of
    the tensor; with the reduce-scatter, 2(world-1)/world (Patarasuk & Yuan 2009).
    """
    chunks = [c.clone() for c in chunks]
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        send_idx, recv_idx = (rank + 1 - s) % world, (rank - s) % world
        buf = torch.empty_like(chunks[recv_idx])
        if rank % 2 == 0:
            dist.send(chunks[send_idx], right)
            dist.recv(buf, left)
        else:
            dist.recv(buf, left)
            dist.send(chunks[send_idx], right)
        chunks[recv_idx] = buf
    return torch.cat(chunks)


def ddp_buckets(
    param_bytes: list[int], bucket_cap_bytes: int, first_bucket_cap_bytes: int = 2**20
) -> list[list[int]]:
    """Lab 01. DDP's gradient buckets (PyTorch DDP, Li et al. 2020 "PyTorch Distributed", §3.2.3).

    ``param_bytes[i]``: bytes of parameter ``i`` in registration order (bytes = numel x element
    size). Take the parameters in *reverse* order (backward produces the last layer's gradients
    first) and pack them into buckets: a bucket closes as soon as it holds its cap or more, the
    first bucket's cap being ``min(first_bucket_cap_bytes, bucket_cap_bytes)`` (small, so the first
    all-reduce starts early in backward), every later one ``bucket_cap_bytes``; the last bucket
    may be smaller. Return the parameter indices of each bucket, e.g. ``[[5, 4], [3, 2, 1], [0]]``.
    """
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(param_bytes))):
        cur.append(i)
        size += param_bytes[i]
        cap = bucket_cap_bytes if buckets else min(first_bucket_cap_bytes, bucket_cap_bytes)
        if size >= cap:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


EXERCISES = [ring_reduce_scatter, ring_all_gather, ddp_buckets]
