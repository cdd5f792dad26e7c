"""Lab 06 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

from llmlab.inference.block_manager import chain_hash


def append_slot(
    block_table: list[int],
    num_tokens: int,
    block_size: int,
    ref_counts: dict[int, int],
    free_blocks: list[int],
) -> tuple[list[int], int | None]:
    """Lab 06. Where does token number ``num_tokens`` (0-based) of a sequence go?

    If it starts a new block, take ``free_blocks.pop(0)`` and append it to the table. If it lands in
    the last block and that block is shared (ref count > 1), copy-on-write: take a fresh block,
    decrement the shared block's ref count, replace it in the table, and return the shared block's
    id as the one to copy from. Returns ``(block_table, copy_from)`` with ``copy_from`` None when
    nothing must be copied; ref counts of new blocks are 1.
    """
    table = list(block_table)
    if num_tokens % block_size == 0:
        b = free_blocks.pop(0)
        ref_counts[b] = 1
        table.append(b)
        return table, None
    last = table[-1]
    if ref_counts[last] > 1:
        b = free_blocks.pop(0)
        ref_counts[b] = 1
        ref_counts[last] -= 1
        table[-1] = b
        return table, last
    return table, None


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """Lab 06. Where the K/V of each token goes in the paged cache (Kwon et al. 2023, §4.1-4.3).

    The cache is ``[num_blocks, block_size, kv_heads, head_dim]``, seen flat as ``num_blocks *
    block_size`` slots. Token position ``pos`` of a sequence lives in its logical block
    ``pos // block_size``, which the ``block_table`` maps to a physical block, at offset
    ``pos % block_size``: return the flat slot ``block_table[pos // block_size] * block_size +
    pos % block_size`` of every position in ``positions`` (a list of ints, one per position; the
    positions of one step may start mid-sequence, e.g. a decode step or a prompt chunk).
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Lab 06. The names of a prompt's blocks in the prefix cache (vLLM automatic prefix caching;
    Kwon et al. 2023, §4.4 on sharing; SGLang's RadixAttention, Zheng et al. 2024, does the same
    with a tree).

    Only *full* blocks are cached: a partly filled last block still changes. Block ``i`` (tokens
    ``token_ids[i*block_size:(i+1)*block_size]``) is named ``chain_hash(parent, tokens)`` with
    ``parent`` the hash of block ``i-1`` (``None`` for block 0), so a block's name covers the whole
    prefix up to it: two prompts share block ``i`` only if all their first ``(i+1)*block_size``
    tokens are equal. ``chain_hash`` is :func:`llmlab.inference.block_manager.chain_hash`
    (``hash((parent, tuple(tokens)))``). Return the list of hashes, one per full block.
    """
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


EXERCISES = [append_slot, slot_mapping, prefix_block_hashes]
