"""Block pool, prefix caching, copy-on-write and the scheduler, in pure Python (no model)."""

from __future__ import annotations

import pytest

from llmlab.inference import block_manager as bm_mod
from llmlab.inference.block_manager import BlockManager
from llmlab.inference.scheduler import Scheduler, SchedulerConfig
from llmlab.inference.sequence import Sequence


def seq(tokens, rid="r", t=0.0, n=1):
    return Sequence(rid, list(tokens), params=None, arrival_time=t, pending_fork=n)


def compute(bm, s, n):
    """What an engine step does for ``s``: allocate, 'compute', register full blocks."""
    hits = bm.lookup_prefix(s)
    if hits:
        n = s.num_tokens - len(hits) * bm.block_size
    copies = bm.allocate(s, n, hits)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)
    return copies


def test_allocate_on_demand_and_free_returns_pool_to_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(10)), seq(range(3))
    compute(bm, a, 10)
    compute(bm, b, 3)
    assert len(a.block_table) == 3 and len(b.block_table) == 1  # ceil(10/4), ceil(3/4)
    assert bm.num_free_blocks == 4
    for _ in range(3):  # decode a: 10 -> 13 tokens
        a.append_token(7)
        compute(bm, a, 1)
    assert len(a.block_table) == 4 and bm.num_free_blocks == 3
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])
    with pytest.raises(RuntimeError):
        bm.allocate(seq(range(40)), 40)  # more than the pool


def test_prefix_cache_shares_blocks_and_evicts_free_cached_blocks():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    compute(bm, a, 10)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 99])
    hits = bm.lookup_prefix(b)
    assert hits == a.block_table[:2]  # two full blocks shared
    compute(bm, b, 9)
    assert b.num_prefix_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    bm.check_invariants([a, b])
    # A prompt equal to one full block still leaves one token to compute (for its logits).
    c = seq([1, 2, 3, 4])
    assert bm.lookup_prefix(c) == []
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 6 and len(bm.hash_to_block) == 2  # cached, yet free
    d = seq([1, 2, 3, 4, 5, 6, 7, 8, 0])  # revives free cached blocks
    compute(bm, d, 9)
    assert d.num_prefix_cached_tokens == 8 and bm.num_free_blocks == 3
    e = seq(range(100, 124))  # 6 blocks: evicts the cache
    bm.free(d)
    old = set(bm.hash_to_block)
    compute(bm, e, 24)
    assert bm.stats["evictions"] == 2 and not old & set(bm.hash_to_block)
    assert len(bm.hash_to_block) == 6  # e's own full blocks
    bm.check_invariants([e])


def test_hash_collision_is_caught_by_the_stored_tokens(monkeypatch):
    monkeypatch.setattr(bm_mod, "chain_hash", lambda parent, tokens: 42)  # everything collides
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = seq([1, 2, 3])
    compute(bm, a, 3)
    assert bm.lookup_prefix(seq([5, 6, 7])) == []  # same hash, other tokens
    assert bm.lookup_prefix(seq([1, 2, 9])) == a.block_table[:1]


def test_copy_on_write_when_a_shared_last_block_is_appended_to():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq([1, 2, 3, 4, 5, 6])  # last block half full
    compute(bm, parent, 6)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert [bm.blocks[x].ref_count for x in parent.block_table] == [2, 2]
    bm.check_invariants([parent, child])
    parent.append_token(10)
    child.append_token(20)
    copies = compute(bm, parent, 1)
    assert len(copies) == 1 and copies[0][0] == child.block_table[1]  # (shared src, new dst)
    assert parent.block_table[0] == child.block_table[0] and parent.block_table[1] != child.block_table[1]
    assert compute(bm, child, 1) == []  # now sole owner: in place
    bm.check_invariants([parent, child])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_swap_out_and_in_conserves_both_pools():
    bm = BlockManager(num_blocks=4, block_size=2, num_host_blocks=4)
    a = seq([1, 2, 3])
    compute(bm, a, 3)
    assert bm.can_swap_out(a)
    pairs = bm.swap_out(a)
    assert len(pairs) == 2 and bm.num_free_blocks == 4 and len(a.host_block_table) == 2
    bm.check_invariants([a])
    back = bm.swap_in(a, 1)
    assert [h for h, _ in back] == [h for _, h in pairs] and bm.num_free_blocks == 2
    bm.check_invariants([a])
    bm.free(a)
    bm.check_invariants([])


def test_invariant_check_detects_a_leak():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3])
    compute(bm, a, 3)
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_invariants([])  # a's blocks unaccounted


def _run(sched, bm, steps=200):
    """Drive the scheduler like the engine: every sequence that reaches its end gets a token,
    and stops after 3 output tokens."""
    log = []
    for _ in range(steps):
        out = sched.schedule()
        if out.is_empty:
            break
        log.append(out)
        sched.update(out)
        for s, _ in out.scheduled:
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(1)
                if s.num_output_tokens >= 3:
                    sched.finish(s, "length")
        bm.check_invariants(sched.live_sequences())
    return log


def test_scheduler_budgets_and_fcfs():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8), bm)
    seqs = [seq(range(n), rid=str(i), t=float(i)) for i, n in enumerate([4, 8, 6])]
    for s in seqs:
        sched.add(s)
    log = _run(sched, bm)
    assert not sched.has_unfinished() and bm.num_free_blocks == 6
    assert all(len(o.scheduled) <= 2 and o.num_batched_tokens <= 8 for o in log)
    assert [s.seq_id for s, _ in log[0].scheduled] == [seqs[0].seq_id]  # 4 + 8 > 8 tokens
    first = [next(i for i, o in enumerate(log) if any(x is s for x, _ in o.scheduled)) for s in seqs]
    assert first[0] < first[1] < first[2]  # FCFS admission
    assert all(s.finish_reason == "length" and s.num_output_tokens == 3 for s in seqs)


def test_scheduler_chunked_prefill_and_recompute_preemption():
    bm = BlockManager(num_blocks=5, block_size=4)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, enable_chunked_prefill=True), bm
    )
    a, b = seq(range(14), rid="a", t=0.0), seq(range(5), rid="b", t=1.0)
    sched.add(a)
    sched.add(b)
    log = _run(sched, bm)
    assert [n for s, n in log[0].scheduled] == [6] and log[0].scheduled[0][0] is a  # a chunk
    assert max(o.num_batched_tokens for o in log) <= 6
    assert sum(len(o.preempted) for o in log) > 0  # 5 blocks cannot hold both
    assert b.num_preemptions > 0 and a.num_preemptions == 0  # the later arrival yields
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3
    assert bm.num_free_blocks == bm.num_blocks
