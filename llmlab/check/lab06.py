"""Checks for the lab 06 exercises (:mod:`llmlab.solutions.lab06`)."""

from __future__ import annotations


from llmlab.check._base import _fail, _ok
from llmlab.solutions import lab06 as ex
from llmlab.inference.block_manager import chain_hash
from llmlab.inference.paged_attention import slot_mapping as engine_slot_mapping


def append_slot(fn) -> bool:
    name = "append_slot"
    cases = [
        ([0], 4, 4, {0: 1}),
        ([0], 2, 4, {0: 1}),
        ([0, 1], 5, 4, {0: 2, 1: 2}),
        ([0, 1], 8, 4, {0: 2, 1: 2}),
    ]
    for table, n, bs, refs in cases:
        want_refs, got_refs = dict(refs), dict(refs)
        want = ex.append_slot(table, n, bs, want_refs, [7, 8])
        got = fn(list(table), n, bs, got_refs, [7, 8])
        if tuple(got) != tuple(want) or got_refs != want_refs:
            _fail(
                name,
                f"appending token {n} to table {table} (block_size {bs}, ref counts {refs})",
                (want, want_refs),
                (got, got_refs),
                "a new block starts when num_tokens % block_size == 0; writing into a shared last "
                "block (ref count > 1) must copy it first (copy-on-write).",
            )
    return _ok(name, "new blocks, in-place appends and copy-on-write all match")


def slot_mapping(fn) -> bool:
    name = "slot_mapping"
    cases = [
        ([3], [0, 1, 2], 4),  # a prompt inside one block
        ([5, 2, 9], list(range(10)), 4),  # a prompt over three scattered blocks
        ([5, 2, 9], [9], 4),  # one decode step in the third block
        ([7, 0], [3, 4, 5], 4),  # a prompt chunk crossing a block boundary
        ([1, 6, 4, 8, 2], list(range(6, 14)), 3),
    ]  # block_size 3
    for table, positions, bs in cases:
        want = engine_slot_mapping(table, positions, bs)
        got = fn(list(table), list(positions), bs)
        got = list(got) if not isinstance(got, int) else got
        if got != want:
            bad = next(
                (i for i, (a, b) in enumerate(zip(want, got if isinstance(got, list) else [])) if a != b),
                min(len(want), len(got) if isinstance(got, list) else 0),
            )
            pos = positions[bad] if bad < len(positions) else None
            if pos is None:
                what, hint = (
                    f"block_table {table}, positions {positions}, block_size {bs}: {len(want)} slots",
                    "return one slot per position",
                )
            else:
                what = (
                    f"position {pos} with block_table {table} and block_size {bs} (logical block "
                    f"{pos // bs} -> physical block {table[pos // bs]}, offset {pos % bs})"
                )
                hint = (
                    "look the logical block up in block_table (blocks are not contiguous), then "
                    "slot = physical_block * block_size + pos % block_size."
                )
            _fail(name, what, want, got, hint)
    return _ok(name, "slots for prompts, chunks and decode steps match the engine's")


def prefix_block_hashes(fn) -> bool:
    name = "prefix_block_hashes"
    prompt = [ord(c) for c in "SCENE II. Capulet's orchard."]  # 28 tokens
    cases = [(prompt, 4), (prompt[:10], 4), (prompt[:8], 4), (prompt[:3], 4), (prompt, 5)]
    for tokens, bs in cases:
        want = ex.prefix_block_hashes(tokens, bs)
        got = list(fn(list(tokens), bs))
        if got == want:
            continue
        where = f"a prompt of {len(tokens)} tokens, block_size {bs} ({len(tokens) // bs} full blocks)"
        if len(got) != len(want):
            hint = (
                "only full blocks are hashed: len(token_ids) // block_size of them; a partly "
                "filled last block is still being written and must not be cached."
                if len(got) > len(want)
                else "hash every full block, the last full one included."
            )
            _fail(name, f"{where}: number of hashes", len(want), len(got), hint)
        i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
        block = tokens[i * bs : (i + 1) * bs]
        unchained = chain_hash(None, block)
        hint = (
            "this is the hash of the block's tokens alone: chain it with the previous block's "
            "hash, chain_hash(parent, tokens), so a block's name covers the whole prefix."
            if got[i] == unchained and i > 0
            else "block i is chain_hash(hash of block i-1 (None for block 0), tuple of its block_size "
            "tokens)."
        )
        _fail(name, f"{where}: hash of block {i} (tokens {block})", want[i], got[i], hint)
    return _ok(name, "chained hashes of full blocks match, partial blocks are left out")
