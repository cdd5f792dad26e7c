"""Checks for the lab 01 exercises (:mod:`llmlab.exercises.lab01`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from llmlab.check._base import _fail, _ok, _close, _run_on_ranks


def _ring_job(fn, world):
    g = torch.Generator().manual_seed(dist.get_rank())
    full = torch.randn(world * 3, generator=g)
    got = fn(list(full.chunk(world)), dist.get_rank(), world)
    return full, got


def ring_reduce_scatter(fn, world: int = 3) -> bool:
    name = "ring_reduce_scatter"
    results = _run_on_ranks(name, _ring_job, world, fn, world)
    total = sum(full for full, _ in results)
    for r, (_, got) in enumerate(results):
        want = total.chunk(world)[(r + 1) % world]
        if not _close(got, want):
            _fail(name, f"rank {r} should end with the fully reduced chunk {(r + 1) % world}",
                  want, got, "in step s send chunk (rank - s) % world to the right and add the "
                             "received tensor into chunk (rank - s - 1) % world; stop after world-1 steps.")
    return _ok(name, f"on {world} real ranks every rank holds its fully reduced chunk")
