"""Checks for the lab 05 exercises (:mod:`llmlab.solutions.lab05`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmlab.check._base import _close, _fail, _ok, _run_on_ranks
from llmlab.solutions import lab05 as ex


def shard_range(fn) -> bool:
    name = "shard_range"
    for numel, world in ((10, 4), (12, 4), (7, 8), (1000, 3)):
        ranges = [tuple(fn(numel, world, r)) for r in range(world)]
        want = [ex.shard_range(numel, world, r) for r in range(world)]
        if ranges != want:
            r = next(i for i, (a, b) in enumerate(zip(want, ranges)) if a != b)
            _fail(
                name,
                f"rank {r} of {world} for a buffer of {numel} elements",
                want[r],
                ranges[r],
                "pad to a multiple of world, cut into equal shards of ceil(numel/world), clip to numel: "
                "shards must tile [0, numel) without gaps or overlaps.",
            )
    return _ok(name, "ZeRO shards tile every buffer exactly, rank by rank")


def _grads(world: int, numel: int) -> list[torch.Tensor]:
    """Every rank's own micro-batch gradient, from one seed (so the caller can compute the average)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randn(numel, generator=g) for _ in range(world)]


def _zero2_job(fn, world, numel):
    rank = dist.get_rank()
    return fn(_grads(world, numel)[rank].clone(), rank, world)


def zero2_grad_shard(fn, world: int = 3, numel: int = 10) -> bool:
    name = "zero2_grad_shard"
    got = _run_on_ranks(name, _zero2_job, world, fn, world, numel)
    mean = torch.stack(_grads(world, numel)).mean(0)
    for r, g in enumerate(got):
        start, end = ex.shard_range(numel, world, r)
        want = mean[start:end]
        if not isinstance(g, torch.Tensor) or g.shape != want.shape:
            _fail(
                name,
                f"rank {r} should return its shard [{start}:{end}) of the averaged gradient "
                f"({numel} elements over {world} ranks), a tensor of shape {list(want.shape)}",
                want,
                g,
                "pad the flat gradient to a multiple of world, reduce-scatter it, and keep "
                "the first end - start elements of this rank's shard (drop the padding).",
            )
        if not _close(g, want):
            summed = torch.stack(_grads(world, numel)).sum(0)[start:end]
            own = _grads(world, numel)[r][start:end]
            why = (
                "this is the SUM over ranks: divide by world to average"
                if _close(g, summed)
                else "this is the rank's own gradient: the shard must be reduced over all ranks"
                if _close(g, own)
                else "reduce-scatter the padded buffer (sum over ranks), divide by world, and return "
                "elements shard_range(numel, world, rank) of the average"
            )
            _fail(name, f"rank {r}'s shard [{start}:{end}) of the averaged gradient", want, g, why)
    return _ok(name, f"on {world} real ranks each rank owns its shard of the averaged gradient")


def _zero1_job(fn, world, numel, lr):
    rank = dist.get_rank()
    param = torch.arange(numel, dtype=torch.float32) / numel
    start, end = ex.shard_range(numel, world, rank)
    grad = torch.stack(_grads(world, numel)).mean(0)[start:end].clone()
    return fn(param.clone(), grad, rank, world, lr)


def zero1_update(fn, world: int = 3, numel: int = 10, lr: float = 0.5) -> bool:
    name = "zero1_update"
    got = _run_on_ranks(name, _zero1_job, world, fn, world, numel, lr)
    param = torch.arange(numel, dtype=torch.float32) / numel
    want = param - lr * torch.stack(_grads(world, numel)).mean(0)
    for r, p in enumerate(got):
        if not _close(p, want):
            if isinstance(p, torch.Tensor) and p.shape == want.shape:
                bad = next(i for i in range(numel) if not torch.isclose(p[i], want[i], atol=1e-5))
                owner = next(o for o in range(world) if ex.shard_range(numel, world, o)[1] > bad)
                stale = torch.isclose(p[bad], param[bad])
                what = f"rank {r}'s updated parameters, first wrong element {bad} (owned by rank {owner})"
                hint = (
                    "that element still holds the old value: after updating its own shard, "
                    "each rank must all-gather the shards of the others"
                    if stale and owner != r
                    else "update only the owned elements shard_range(numel, world, rank) with "
                    "p - lr * grad_shard, then all-gather the padded shards and drop the padding"
                )
            else:
                what, hint = (
                    f"rank {r} should return the full updated parameters, shape [{numel}]",
                    "all-gather the padded shards into a buffer of world * ceil(numel/world) "
                    "elements and return its first numel elements",
                )
            _fail(name, what, want, p, hint)
    return _ok(name, f"on {world} real ranks every rank holds the same fully updated parameters")
