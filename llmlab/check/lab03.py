"""Checks for the lab 03 exercises (:mod:`llmlab.solutions.lab03`)."""

from __future__ import annotations


import math

import torch
import torch.distributed as dist

from llmlab.check._base import _close, _fail, _ok, _run_on_ranks
from llmlab.solutions import lab03 as ex


def one_f_one_b(fn) -> bool:
    name = "one_f_one_b"
    for p, m in ((4, 8), (4, 2), (2, 1), (3, 5)):
        for s in range(p):
            want, got = ex.one_f_one_b(s, p, m), list(map(tuple, fn(s, p, m)))
            if got != want:
                i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                _fail(
                    name,
                    f"stage {s} of {p}, {m} micro-batches: first difference at action {i}",
                    want,
                    got,
                    "warm-up forwards = min(p - stage - 1, m); then one F and one B "
                    "alternating; micro-batches go in increasing order in each direction.",
                )
    return _ok(name, "1F1B action lists for 4 pipeline shapes match, every stage")


def bubble_fraction(fn) -> bool:
    name = "bubble_fraction"
    for p, m, v in ((4, 8, 1), (2, 1, 1), (4, 16, 1), (1, 4, 1), (4, 8, 2), (2, 8, 4)):
        want, got = ex.bubble_fraction(p, m, v), fn(p, m, v)
        if not (isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)):
            hint = (
                "the bubble is relative to the total time of a flush: (p-1) idle slots over m + p - 1 slots"
                if v == 1
                else "with v chunks per rank a rank has v·m (shorter) slots of work: (p-1)/(v·m+p-1)"
            )
            if p == 1:
                hint = "one stage never waits: the bubble is 0."
            _fail(name, f"p={p} stages, m={m} micro-batches, v={v} chunks per rank", want, got, hint)
    return _ok(
        name, "bubble fractions for 6 pipeline shapes match (p-1)/(v·m+p-1), as the simulator measures"
    )


def _stage(rank: int, h: int):
    torch.manual_seed(100 + rank)  # this stage's layer: the same on every rank
    lin = torch.nn.Linear(h, h)
    return lambda x: torch.tanh(lin(x))


def _pipe_job(fn, world, m):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randn(2, 4, generator=g) for _ in range(m)]
    with torch.no_grad():
        want = []
        for x in mbs:
            for r in range(world):
                x = _stage(r, 4)(x)
            want.append(x)
        got = fn(mbs if rank == 0 else [torch.zeros_like(x) for x in mbs], _stage(rank, 4), rank, world)
    return got, want


def pipeline_forward(fn, world: int = 3, m: int = 3) -> bool:
    name = "pipeline_forward"
    for r, (got, want) in enumerate(_run_on_ranks(name, _pipe_job, world, fn, world, m)):
        if r < world - 1:
            if got is not None:
                _fail(
                    name,
                    f"rank {r} is not the last stage: it should return None",
                    None,
                    got,
                    "only the last stage keeps the outputs; the others send theirs to rank + 1.",
                )
            continue
        if not isinstance(got, (list, tuple)) or len(got) != m:
            _fail(
                name,
                f"the last stage (rank {r}) should return a list of {m} outputs",
                want,
                got,
                "append stage_fn(received activation) for every micro-batch, in order.",
            )
        for i, (a, b) in enumerate(zip(want, got)):
            if not _close(b, a):
                j = next((j for j, w in enumerate(want) if _close(b, w)), None)
                hint = (
                    f"it is the output of micro-batch {j}: keep the micro-batches in order on every stage"
                    if j is not None
                    else "each stage applies its own stage_fn once to what it receives (stage 0: to the "
                    "micro-batch), then sends the result on; the last stage applies it too."
                )
                _fail(name, f"rank {r} (last stage), output of micro-batch {i}", a, b, hint)
    return _ok(name, f"on {world} real ranks {m} micro-batches flow through the stages and come out right")
