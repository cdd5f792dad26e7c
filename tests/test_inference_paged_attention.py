"""PagedAttention through block tables equals dense causal attention on each sequence."""

from __future__ import annotations

import random

import pytest
import torch

from llmlab.inference.paged_attention import dense_attention, paged_attention, slot_mapping, write_kv


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_equals_dense_on_ragged_prefill_and_decode(block_size):
    torch.manual_seed(0)
    rng = random.Random(block_size)
    H, Hkv, D, num_blocks = 4, 2, 8, 64
    k_cache = torch.zeros(num_blocks, block_size, Hkv, D, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, non-contiguous blocks
    # (context length, new tokens): decode, prefill, block-boundary lengths, prefix-cached chunk
    cases = [
        (1, 1),
        (block_size, block_size),
        (block_size + 1, 1),
        (2 * block_size + 3, 5),
        (3 * block_size, 1),
        (7, 7),
    ]
    qs, tables, dense = [], [], []
    for ctx, n in cases:
        nb = -(-ctx // block_size)
        table = [free.pop() for _ in range(nb)]
        k = torch.randn(ctx, Hkv, D, dtype=torch.float64)
        v = torch.randn(ctx, Hkv, D, dtype=torch.float64)
        q = torch.randn(n, H, D, dtype=torch.float64)
        write_kv(k_cache, v_cache, k, v, torch.tensor(slot_mapping(table, range(ctx), block_size)))
        qs.append(q)
        tables.append(table)
        dense.append(dense_attention(q, k, v))
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = paged_attention(
        torch.cat(qs),
        k_cache,
        v_cache,
        bt,
        torch.tensor([c for c, _ in cases]),
        torch.tensor([n for _, n in cases]),
    )
    torch.testing.assert_close(out, torch.cat(dense), rtol=1e-10, atol=1e-10)


def test_dense_reference_is_sdpa_causal():
    torch.manual_seed(1)
    q, k, v = (torch.randn(6, 2, 4, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(dense_attention(q, k, v), ref)
