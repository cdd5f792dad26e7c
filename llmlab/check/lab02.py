"""Checks for the lab 02 exercises (:mod:`llmlab.solutions.lab02`)."""

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
            hint = (
                "each rank holds a partial sum: all-reduce it before adding the bias once"
                if isinstance(got, torch.Tensor) and got.shape == want.shape
                else "the output is [batch, out_features], the same full tensor on every rank"
            )
            _fail(name, f"rank {r} output differs from the full matmul x @ W.T + b", want, got, hint)
    return _ok(name, f"on {tp} real ranks the row-parallel output equals the full linear layer")


def _column_job(fn, tp):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    r = dist.get_rank()
    full = x @ w.t() + b
    w_r, b_r = w.chunk(tp, dim=0)[r].contiguous(), b.chunk(tp)[r].contiguous()
    return {
        gather: (fn(x, w_r, b_r, gather, None), full if gather else full.chunk(tp, dim=1)[r])
        for gather in (False, True)
    }


def column_parallel_forward(fn, tp: int = 2) -> bool:
    name = "column_parallel_forward"
    results = _run_on_ranks(name, _column_job, tp, fn, tp)
    for gather in (False, True):
        for r, (got, want) in enumerate(res[gather] for res in results):
            if not _close(got, want):
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                if not gather and shape == tuple(want.shape):
                    hint = (
                        "the shape is right, so look at the values: y = x @ w_shard.T + b_shard, "
                        "this rank's bias slice added once, no communication"
                    )
                elif not gather:
                    hint = (
                        f"without gather_output the output is this rank's slice, [batch, out/tp] = "
                        f"{tuple(want.shape)}, got {shape}: no communication"
                    )
                else:
                    hint = (
                        f"with gather_output, all-gather the [batch, out/tp] slices and concatenate "
                        f"them on the last dim in rank order: [batch, out] = {tuple(want.shape)}, got {shape}"
                    )
                _fail(
                    name,
                    f"rank {r}, gather_output={gather}: output differs from "
                    f"{'x @ W.T + b' if gather else f'slice {r} of x @ W.T + b'}",
                    want,
                    got,
                    hint,
                )
    return _ok(name, f"on {tp} real ranks: the local [B, out/tp] slice and the gathered [B, out] output")


def _ce_job(fn, tp, vocab, tokens):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[0], target[1] = 0, vocab - 1  # first and last id of the vocabulary
    r, per = dist.get_rank(), vocab // tp
    got = fn(logits[:, r * per : (r + 1) * per].contiguous(), target, r * per, None)
    return got, F.cross_entropy(logits, target, reduction="none"), target


def vocab_parallel_cross_entropy(fn, tp: int = 2) -> bool:
    name = "vocab_parallel_cross_entropy"
    for r, (got, want, target) in enumerate(_run_on_ranks(name, _ce_job, tp, fn, tp, 16, 6)):
        if not _close(got, want):
            per = 16 // tp
            bad = (
                [i for i in range(len(want)) if abs(float(got[i]) - float(want[i])) > 1e-4]
                if isinstance(got, torch.Tensor) and got.shape == want.shape
                else "all"
            )
            where = (
                ""
                if bad == "all"
                else f" (tokens {bad}, targets {[int(target[i]) for i in bad]}, on ranks "
                f"{sorted({int(target[i]) // per for i in bad})})"
            )
            _fail(
                name,
                f"rank {r}: per-token loss differs from F.cross_entropy on the full logits{where}",
                want,
                got,
                "three all-reduces over the group: the max with ReduceOp.MAX (the same max "
                "on every rank), the sum of exp(logit - max), and the target's shifted logit, "
                "which only the rank holding the target id contributes (mask it to 0 elsewhere).",
            )
    return _ok(
        name, f"on {tp} real ranks the vocab-parallel loss of every token equals the full cross-entropy"
    )
