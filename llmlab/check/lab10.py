"""Checks for the lab 10 exercises (:mod:`llmlab.solutions.lab10`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmlab.check._base import _close, _fail, _ok, _run_on_ranks
from llmlab.solutions import lab10 as ex


def _partial(s, v):
    lse = torch.logsumexp(s, -1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s - safe[:, None]) @ v, lse


def merge_partials(fn) -> bool:
    name = "merge_partials"
    g = torch.Generator().manual_seed(10)
    s, v = torch.randn(5, 12, generator=g) * 4, torch.randn(12, 3, generator=g)
    s[:, 0] += 60.0  # a large score: exp without the max subtraction overflows
    s[3, :7] = float("-inf")  # row 3 sees no key of part A
    s[4, :] = float("-inf")  # row 4 sees no key at all
    out, lse = fn(*_partial(s[:, :7], v[:7]), *_partial(s[:, 7:], v[7:]))
    want_out, want_lse = ex.merge_partials(*_partial(s[:, :7], v[:7]), *_partial(s[:, 7:], v[7:]))
    if not isinstance(out, torch.Tensor) or out.shape != want_out.shape:
        _fail(
            name,
            "the merged output",
            f"a tensor of shape {list(want_out.shape)}",
            out,
            "return (out [Q, D], lse [Q]).",
        )
    if torch.isnan(out).any() or torch.isnan(lse).any():
        row = int(torch.isnan(out).any(-1).nonzero()[0]) if torch.isnan(out).any() else 4
        _fail(
            name,
            f"row {row} contains nan",
            want_out[row],
            out[row],
            "rows 0-2 have a score of ~60: exp(lse) overflows unless you subtract m = max(lse_a, "
            "lse_b) first; row 4 sees no key (both lse = -inf): use m = 0 there and divide by "
            "a total clamped away from 0.",
        )
    for r in range(5):
        if not _close(out[r], want_out[r]):
            hint = (
                "row 3 has no key in part A (lse_a = -inf): its weight exp(lse_a - m) must be 0"
                if r == 3
                else "row 4 has no key at all: out should be 0"
                if r == 4
                else "weight each part by exp(lse_part - lse) where lse = m + log(exp(lse_a - m) + "
                "exp(lse_b - m)); both parts are already normalised on their own."
            )
            _fail(name, f"merged output, row {r}", want_out[r], out[r], hint)
    if not torch.allclose(lse[:4], want_lse[:4], atol=1e-5) or lse[4] != float("-inf"):
        _fail(
            name,
            "merged lse",
            want_lse,
            lse,
            "lse = m + log(exp(lse_a - m) + exp(lse_b - m)); -inf for a row that saw no key.",
        )
    full = torch.softmax(s[:4], -1) @ v
    assert torch.allclose(want_out[:4], full, atol=1e-5)
    return _ok(
        name, "two partial softmaxes merge into softmax over all keys (large scores and empty rows included)"
    )


def load_balanced_indices(fn) -> bool:
    name = "load_balanced_indices"
    for S, cp in ((8, 2), (16, 4), (12, 3), (8, 1)):
        for r in range(cp):
            want, got = ex.load_balanced_indices(S, cp, r), fn(S, cp, r)
            got = [int(i) for i in got] if isinstance(got, (list, tuple, torch.Tensor)) else got
            if got != want:
                c = S // (2 * cp)
                _fail(
                    name,
                    f"seq_len {S}, cp {cp}, rank {r} (chunks of {c} tokens)",
                    want,
                    got,
                    f"rank {r} holds chunk {r} (positions {r * c}..{(r + 1) * c - 1}) then chunk "
                    f"{2 * cp - 1 - r} = 2*cp-1-rank.",
                )
    work = [sum(p + 1 for p in ex.load_balanced_indices(32, 4, r)) for r in range(4)]
    return _ok(name, f"chunks i and 2N-1-i for 4 layouts; causal work per rank at N=4: {work}")


def _seq_to_head_job(fn, H):
    r, n = dist.get_rank(), dist.get_world_size()
    full = torch.randn(2, H, 4 * n, 3, generator=torch.Generator().manual_seed(7))
    local = full[:, :, 4 * r : 4 * (r + 1)].clone()
    return fn(local, dist.group.WORLD), full[:, r * H // n : (r + 1) * H // n]


def seq_to_head(fn, world: int = 2, heads: int = 4) -> bool:
    name = "seq_to_head"
    for r, (got, want) in enumerate(_run_on_ranks(name, _seq_to_head_job, world, fn, heads)):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            _fail(
                name,
                f"rank {r}'s result shape",
                list(want.shape),
                list(got.shape) if isinstance(got, torch.Tensor) else got,
                "[B, H/N, N*T, D]: this rank's H/N heads of every rank's T tokens.",
            )
        if not _close(got, want):
            _fail(
                name,
                f"rank {r}: heads {r * heads // world}..{(r + 1) * heads // world - 1} of all "
                f"{4 * world} tokens",
                want[0, 0, :, 0],
                got[0, 0, :, 0],
                "dim 0 of the all-to-all input must be the destination rank: permute heads first, "
                "reshape to [N, H/N, B, T, D]; the received dim 0 is the source rank, whose tokens "
                "come in rank order.",
            )
    return _ok(name, f"on {world} real ranks: sequence shards -> head shards with one all-to-all")
