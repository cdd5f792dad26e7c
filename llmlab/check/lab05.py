"""Checks for the lab 05 exercises (:mod:`llmlab.exercises.lab05`)."""
from __future__ import annotations


from llmlab.check._base import _fail, _ok
from llmlab.exercises import lab05 as ex


def shard_range(fn) -> bool:
    name = "shard_range"
    for numel, world in ((10, 4), (12, 4), (7, 8), (1000, 3)):
        ranges = [tuple(fn(numel, world, r)) for r in range(world)]
        want = [ex.shard_range(numel, world, r) for r in range(world)]
        if ranges != want:
            r = next(i for i, (a, b) in enumerate(zip(want, ranges)) if a != b)
            _fail(name, f"rank {r} of {world} for a buffer of {numel} elements", want[r], ranges[r],
                  "pad to a multiple of world, cut into equal shards of ceil(numel/world), clip to numel: "
                  "shards must tile [0, numel) without gaps or overlaps.")
    return _ok(name, "ZeRO shards tile every buffer exactly, rank by rank")
