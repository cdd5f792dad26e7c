"""Checks for the lab 02 exercises (:mod:`llmlab.exercises.lab02`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from llmlab.check._base import _fail, _ok, _close, _run_on_ranks


def _row_job(fn, tp):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    r = dist.get_rank()
    return fn(x.chunk(tp, dim=1)[r].contiguous(), w.chunk(tp, dim=1)[r].contiguous(), b, None), x @ w.t() + b


def row_parallel_forward(fn, tp: int = 2) -> bool:
    name = "row_parallel_forward"
    for r, (got, want) in enumerate(_run_on_ranks(name, _row_job, tp, fn, tp)):
        if not _close(got, want):
            hint = ("each rank holds a partial sum: all-reduce it before adding the bias once"
                    if isinstance(got, torch.Tensor) and got.shape == want.shape else
                    "the output is [batch, out_features], the same full tensor on every rank")
            _fail(name, f"rank {r} output differs from the full matmul x @ W.T + b", want, got, hint)
    return _ok(name, f"on {tp} real ranks the row-parallel output equals the full linear layer")
