"""Checks for the lab 01 exercises (:mod:`llmlab.solutions.lab01`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmlab.check._base import _fail, _ok, _close, _run_on_ranks
from llmlab.solutions import lab01 as ex


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
            _fail(
                name,
                f"rank {r} should end with the fully reduced chunk {(r + 1) % world}",
                want,
                got,
                "in step s send chunk (rank - s) % world to the right and add the "
                "received tensor into chunk (rank - s - 1) % world; stop after world-1 steps.",
            )
    return _ok(name, f"on {world} real ranks every rank holds its fully reduced chunk")


def _gather_job(fn, world):
    # Each rank's tensor is random; the reduced sum is known to all ranks (to build the inputs),
    # but rank r only gets the reduced chunk (r + 1) % world: the others stay its own stale values.
    rank = dist.get_rank()
    fulls = [torch.randn(world * 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    total = sum(fulls)
    chunks = list(fulls[rank].chunk(world))
    chunks[(rank + 1) % world] = total.chunk(world)[(rank + 1) % world].clone()
    return total, fn(chunks, rank, world)


def ring_all_gather(fn, world: int = 3) -> bool:
    name = "ring_all_gather"
    for r, (want, got) in enumerate(_run_on_ranks(name, _gather_job, world, fn, world)):
        if isinstance(got, (list, tuple)):
            got = torch.cat(list(got))
        if not _close(got, want):
            bad = (
                [
                    i
                    for i, (a, b) in enumerate(zip(want.chunk(world), got.chunk(world)))
                    if not torch.allclose(a, b, atol=1e-5)
                ]
                if isinstance(got, torch.Tensor) and got.shape == want.shape
                else "all"
            )
            _fail(
                name,
                f"rank {r} should end with every reduced chunk; chunk(s) {bad} differ",
                want,
                got,
                "in step s send chunk (rank + 1 - s) % world to the right and overwrite (do not add) "
                "chunk (rank - s) % world with what arrives from the left; world-1 steps.",
            )
    return _ok(name, f"on {world} real ranks every rank ends with the whole reduced tensor")


def ddp_buckets(fn) -> bool:
    name = "ddp_buckets"
    from llmlab.model.config import get_preset
    from llmlab.model.llama import LlamaForCausalLM

    tiny = [p.numel() * p.element_size() for p in LlamaForCausalLM(get_preset("tiny"), seed=0).parameters()]
    cases = [
        ([4, 4, 4, 4, 4, 4], 8, 4),
        ([10, 1, 1, 1, 10], 5, 100),
        ([3, 3, 3], 100, 100),
        ([400, 400, 400, 400], 1000, 1000),
        (tiny, int(0.05 * 2**20), 2**20),
        (tiny, 25 * 2**20, 2**20),
        (tiny, 64 * 1024, 16 * 1024),
    ]
    for sizes, cap, first in cases:
        want, got = ex.ddp_buckets(sizes, cap, first), fn(sizes, cap, first)
        got = [list(b) for b in got] if isinstance(got, (list, tuple)) else got
        if got != want:
            label = "the tiny model's parameters" if sizes is tiny else f"parameter bytes {sizes}"
            if not isinstance(got, list):
                _fail(
                    name,
                    f"{label}: return a list of buckets, each a list of parameter indices",
                    want,
                    got,
                    "e.g. [[5, 4], [3, 2, 1], [0]]: the last parameters come first.",
                )
            i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            _fail(
                name,
                f"{label}, bucket_cap {cap} bytes, first bucket cap {first} bytes: "
                f"bucket {i} differs ({len(want)} buckets expected, {len(got)} returned)",
                want,
                got,
                "walk the parameters from the last to the first; close a bucket as soon "
                "as it holds its cap or more (the first bucket's cap is min(first, cap)); "
                "keep the leftover as a last, smaller bucket.",
            )
    return _ok(
        name, "bucket assignment matches for 7 cases, among them the tiny model at bucket_mb 0.05 and 25"
    )
