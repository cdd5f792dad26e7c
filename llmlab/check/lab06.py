"""Checks for the lab 06 exercises (:mod:`llmlab.exercises.lab06`)."""
from __future__ import annotations


from llmlab.check._base import _fail, _ok
from llmlab.exercises import lab06 as ex


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
