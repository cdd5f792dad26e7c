"""Checks for the learner exercises in :mod:`llmlab.exercises`.

Each ``check.<exercise>(fn)`` runs the learner's ``fn`` (on real ranks when the exercise is about
communication) and llmlab's reference on the same seed and data. On success it prints what was
checked and returns ``True``; otherwise it raises :class:`ExerciseFailed` saying in plain words
which rank and which value differ, what was expected and what came back, and a hint.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from llmlab import exercises as ex
from llmlab.runtime.launch import RankError, launch


class ExerciseFailed(Exception):
    """The learner's function disagrees with the reference; the message says where and how."""


def _fail(name: str, what: str, expected, got, hint: str):
    raise ExerciseFailed(f"{name}: {what}\n  expected: {_show(expected)}\n  got:      {_show(got)}\n"
                         f"  hint: {hint}")


def _show(v) -> str:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    s = repr(v)
    return s if len(s) < 300 else s[:300] + " ..."


def _ok(name: str, what: str) -> bool:
    print(f"✓ {name}: {what}")
    return True


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def _run_on_ranks(name: str, fn, world: int, *args):
    try:
        return launch(fn, world, *args, backend="gloo", timeout=60)
    except RankError as e:
        raise ExerciseFailed(f"{name}: rank {e.rank} raised an error:\n{e.rank_traceback[-1500:]}\n"
                             f"  hint: every rank must take part in each send/recv/collective, in an "
                             f"order that cannot leave two ranks waiting on each other.") from None
    except TimeoutError:
        raise ExerciseFailed(f"{name}: the ranks did not finish within 60 s (deadlock?)\n  hint: if "
                             f"every rank sends before it receives, blocking sends can wait forever; "
                             f"alternate the order on even and odd ranks.") from None


# --- lab 00 ---------------------------------------------------------------------------------
def training_memory_bytes(fn) -> bool:
    name = "training_memory_bytes"
    for n in (1, 8_000_000_000, 123_456):
        want, got = ex.training_memory_bytes(n), fn(n)
        for k in want:
            if not isinstance(got, dict) or got.get(k) != want[k]:
                _fail(name, f"{k} for {n:,} parameters", want, got,
                      "fp32 is 4 bytes; Adam keeps two states (m and v) per parameter.")
    return _ok(name, "bytes for 3 model sizes match 4Ψ / 4Ψ / 8Ψ (the seed's 32 / 32 / 64 GB for 8B)")


# --- lab 01 ---------------------------------------------------------------------------------
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


# --- lab 02 ---------------------------------------------------------------------------------
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


# --- lab 03 ---------------------------------------------------------------------------------
def one_f_one_b(fn) -> bool:
    name = "one_f_one_b"
    for p, m in ((4, 8), (4, 2), (2, 1), (3, 5)):
        for s in range(p):
            want, got = ex.one_f_one_b(s, p, m), list(map(tuple, fn(s, p, m)))
            if got != want:
                i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                _fail(name, f"stage {s} of {p}, {m} micro-batches: first difference at action {i}",
                      want, got, "warm-up forwards = min(p - stage - 1, m); then one F and one B "
                                 "alternating; micro-batches go in increasing order in each direction.")
    return _ok(name, "1F1B action lists for 4 pipeline shapes match, every stage")


# --- lab 04 ---------------------------------------------------------------------------------
def topk_route(fn) -> bool:
    name = "topk_route"
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 4, generator=g)
    for k, cap in ((1, None), (2, None), (2, 4), (1, 2)):
        want, got = ex.topk_route(logits, k, cap), fn(logits, k, cap)
        for part, w, o in zip(("experts", "weights", "kept"), want, got):
            if not (torch.equal(w, o) if w.dtype in (torch.bool, torch.int64) else _close(o, w)):
                _fail(name, f"{part} for k={k}, capacity={cap}", w, o,
                      "weights are softmax probabilities renormalised over the chosen k; an expert "
                      "keeps assignments in token order until it has `capacity`.")
    return _ok(name, "top-1/top-2 routing, renormalised weights and capacity drops match")


# --- lab 05 ---------------------------------------------------------------------------------
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


# --- lab 06 ---------------------------------------------------------------------------------
def append_slot(fn) -> bool:
    name = "append_slot"
    cases = [([0], 4, 4, {0: 1}), ([0], 2, 4, {0: 1}), ([0, 1], 5, 4, {0: 2, 1: 2}),
             ([0, 1], 8, 4, {0: 2, 1: 2})]
    for table, n, bs, refs in cases:
        want_refs, got_refs = dict(refs), dict(refs)
        want = ex.append_slot(table, n, bs, want_refs, [7, 8])
        got = fn(list(table), n, bs, got_refs, [7, 8])
        if tuple(got) != tuple(want) or got_refs != want_refs:
            _fail(name, f"appending token {n} to table {table} (block_size {bs}, ref counts {refs})",
                  (want, want_refs), (got, got_refs),
                  "a new block starts when num_tokens % block_size == 0; writing into a shared last "
                  "block (ref count > 1) must copy it first (copy-on-write).")
    return _ok(name, "new blocks, in-place appends and copy-on-write all match")


# --- lab 07 ---------------------------------------------------------------------------------
def schedule_step(fn) -> bool:
    name = "schedule_step"
    cases = [([("a", 1), ("b", 1)], [("c", 30), ("d", 5)], 4, 16),
             ([], [("c", 30)], 4, 16), ([("a", 1)], [("c", 3), ("d", 5)], 2, 100)]
    for running, waiting, s, t in cases:
        want, got = ex.schedule_step(running, waiting, s, t), fn(running, waiting, s, t)
        if list(map(tuple, got)) != want:
            _fail(name, f"running={running}, waiting={waiting}, max_num_seqs={s}, "
                        f"max_num_batched_tokens={t}", want, got,
                  "running requests first, then waiting ones in order; a prompt that does not fit "
                  "the remaining budget gets a chunk of it (chunked prefill).")
    return _ok(name, "token budgets, max_num_seqs and chunked prefill match")


# --- lab 08 ---------------------------------------------------------------------------------
def rank_coords(fn) -> bool:
    name = "rank_coords"
    for dp, tp, pp in ((2, 2, 2), (2, 4, 1), (1, 2, 4)):
        for r in range(dp * tp * pp):
            want, got = ex.rank_coords(r, dp, tp, pp), fn(r, dp, tp, pp)
            if got != want:
                _fail(name, f"rank {r} in dp{dp} x tp{tp} x pp{pp}", want, got,
                      "tensor parallel is the fastest-varying index (same node), then data, then "
                      "pipeline.")
    return _ok(name, "Megatron coordinates for 3 meshes match")


# --- lab 09 ---------------------------------------------------------------------------------
def online_softmax_update(fn) -> bool:
    name = "online_softmax_update"
    g = torch.Generator().manual_seed(0)
    q_len, d = 3, 4
    scores, v = torch.randn(q_len, 12, generator=g) * 3, torch.randn(12, d, generator=g)
    m, l, acc = torch.full((q_len,), float("-inf")), torch.zeros(q_len), torch.zeros(q_len, d)
    for j in range(0, 12, 4):
        m, l, acc = fn(m, l, acc, scores[:, j:j + 4], v[j:j + 4])
    want = scores.softmax(-1) @ v
    got = acc / l[:, None]
    if not _close(got, want):
        _fail(name, "after 3 tiles, acc / l should equal softmax(scores) @ V", want, got,
              "when the running max grows, rescale the old l and acc by exp(m_old - m_new).")
    return _ok(name, "three tiles of online softmax equal the full softmax @ V")
