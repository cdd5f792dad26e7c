"""Lab 06 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations



def append_slot(block_table: list[int], num_tokens: int, block_size: int,
                ref_counts: dict[int, int], free_blocks: list[int]) -> tuple[list[int], int | None]:
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


EXERCISES = [append_slot]
