"""The paged KV cache's bookkeeping: a ref-counted pool of fixed-size blocks.

PagedAttention (Kwon et al., SOSP 2023, §4.1-4.4): the cache is cut into blocks of
``block_size`` tokens; each sequence owns a *block table* mapping its logical blocks to physical
ones, allocated on demand as it grows, so at most one partly filled block per sequence is wasted.

- **Ref counts** let several sequences point at one physical block (§4.4).
- **Prefix caching** (vLLM "automatic prefix caching"): a *full* block is named by a chained
  hash ``hash((parent_hash, its tokens))``; a new prompt whose first blocks hash the same reuses
  them instead of recomputing. Freed blocks keep their contents and hash in the free queue (LRU
  order) until they are evicted by an allocation. On a hit the stored tokens are compared too, so
  a hash collision can never serve wrong K/V.
- **Copy-on-write** (§4.4, parallel sampling): after a fork the samples share the prompt's last,
  partly filled block; the first sample to append to it gets a private copy (the ``(src, dst)``
  pair is returned so the model runner copies the K/V).
- **Swap** (§4.5): a preempted sequence's blocks can be moved to a pool of host blocks.

Pure Python, no torch: the model runner turns block ids into tensor indices.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from llmlab.inference.sequence import BlockTokens, Sequence

# The parent of a block's chained hash: the previous block's hash, or for a sequence's first
# block its salt (None, or ("lora", adapter id): see _salt).
Parent = int | tuple[str, int] | None


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # chained hash while registered in the prefix cache
    parent_hash: Parent = None
    token_ids: BlockTokens | None = None  # the tokens the hash names (checked on a hit)


def _salt(seq: Sequence) -> tuple[str, int] | None:
    """The parent of a sequence's first block: ``None``, or its LoRA adapter (K/V computed with an
    adapter are not the base's, nor another adapter's: vLLM keys its prefix cache the same way)."""
    return ("lora", seq.lora_id) if seq.lora_id else None


def chain_hash(parent_hash: Parent, token_ids: Iterable[object]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first)."""
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    """``num_blocks`` device blocks of ``block_size`` tokens, and ``num_host_blocks`` host blocks.

    Raises ``ValueError`` for non-positive sizes. Allocation methods never partially succeed:
    callers check :meth:`can_allocate` first, and :meth:`allocate` raises ``RuntimeError`` if
    the pool cannot serve (a scheduler bug, not a user error).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, num_host_blocks: int = 0
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self._seq_hashes: dict[int, list[int]] = {}  # seq_id -> chain hashes of full blocks
        self.num_host_blocks = num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks))
        self.stats = {"prefix_hit_tokens": 0, "prefix_query_tokens": 0, "cow_copies": 0, "evictions": 0}

    # --- counts --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # --- pool primitives -------------------------------------------------------------------------
    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash is not None:  # evict a cached block
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = block.parent_hash = block.token_ids = None
            self.stats["evictions"] += 1
        block.ref_count = 1
        return block_id

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed with ref_count={block.ref_count}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    # --- prefix cache --------------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq.token_ids`` (no state change).

        At least one token is always left to compute, since its logits are needed to sample;
        none is taken for a sequence that must compute its whole prompt (``skip_prefix_cache``)."""
        if (
            not self.enable_prefix_caching
            or seq.block_table
            or seq.num_computed_tokens
            or seq.skip_prefix_cache
        ):
            return []
        hits: list[int] = []
        parent: Parent = _salt(seq)
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.block_tokens(i * bs, (i + 1) * bs)
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if (
                block_id is None
                or self.blocks[block_id].token_ids != tokens
                or self.blocks[block_id].parent_hash != parent
            ):
                break  # miss (or a hash collision)
            hits.append(block_id)
            parent = h
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the full, computed blocks of ``seq`` in the prefix cache (after a step)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), seq.num_computed_tokens // bs):
            tokens = seq.block_tokens(i * bs, (i + 1) * bs)
            parent = hashes[-1] if hashes else _salt(seq)
            h = chain_hash(parent, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.parent_hash, block.token_ids = h, parent, tokens
                self.hash_to_block[h] = block.block_id

    def _cached_hash(self, block_id: int) -> int:
        """The hash of a block in the prefix cache (a :meth:`lookup_prefix` hit always is)."""
        h = self.blocks[block_id].hash
        if h is None:
            raise RuntimeError(f"block {block_id} is not in the prefix cache (a scheduler bug)")
        return h

    # --- allocation ----------------------------------------------------------------------------
    def _needs_cow(self, seq: Sequence) -> bool:
        return (
            bool(seq.block_table)
            and seq.num_computed_tokens % self.block_size != 0
            and self.blocks[seq.block_table[-1]].ref_count > 1
        )

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: Collection[int] = ()) -> int:
        """Free blocks an :meth:`allocate` of ``num_new_tokens`` would take from the pool."""
        computed = len(hits) * self.block_size if hits else seq.num_computed_tokens
        have = len(hits) if hits else len(seq.block_table)
        new = max(0, self.blocks_for(computed + num_new_tokens) - have)
        cow = 0 if hits else int(num_new_tokens > 0 and self._needs_cow(seq))
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits now in free queue
        return new + cow + revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: Collection[int] = ()) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, hits) <= self.num_free_blocks

    def allocate(
        self, seq: Sequence, num_new_tokens: int, hits: Collection[int] = ()
    ) -> list[tuple[int, int]]:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens; returns copy-on-write pairs
        ``(src_block, dst_block)`` whose K/V the runner must copy before the step.

        ``hits`` (from :meth:`lookup_prefix`, only for a sequence without blocks) are taken over
        first and advance ``seq.num_computed_tokens``."""
        if not self.can_allocate(seq, num_new_tokens, hits):
            raise RuntimeError(
                f"allocate: {self.num_blocks_needed(seq, num_new_tokens, hits)} "
                f"blocks needed, {self.num_free_blocks} free"
            )
        if self.enable_prefix_caching and not seq.block_table and not seq.num_computed_tokens:
            self.stats["prefix_query_tokens"] += seq.num_tokens
        copies = []
        if hits:
            for b in hits:
                self._touch(b)
            seq.block_table = list(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_prefix_cached_tokens = seq.num_computed_tokens
            self._seq_hashes[seq.seq_id] = [self._cached_hash(b) for b in hits]
            self.stats["prefix_hit_tokens"] += seq.num_computed_tokens
        elif num_new_tokens > 0 and self._needs_cow(seq):
            src = seq.block_table[-1]
            dst = self._pop_free()
            self.blocks[src].ref_count -= 1  # stays > 0: others hold it
            seq.block_table[-1] = dst
            copies.append((src, dst))
            self.stats["cow_copies"] += 1
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._pop_free())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (ref counts +1); CoW happens on append."""
        child.block_table = list(parent.block_table)
        for b in child.block_table:
            self._touch(b)
        self._seq_hashes[child.seq_id] = list(self._seq_hashes.get(parent.seq_id, []))

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s device (and host) blocks; tail blocks go first so they are evicted
        before the shared prefix blocks."""
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = []
        self.host_free.extend(reversed(seq.host_block_table))
        seq.host_block_table = []
        self._seq_hashes.pop(seq.seq_id, None)

    # --- swap (device <-> host) ------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        """Only unshared sequences are swapped; a shared one is preempted by recompute."""
        return len(seq.block_table) <= len(self.host_free) and all(
            self.blocks[b].ref_count == 1 for b in seq.block_table
        )

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq`` to host blocks; returns ``(device_block, host_block)`` copy pairs."""
        pairs = [(b, self.host_free.pop()) for b in seq.block_table]
        for b in reversed(seq.block_table):
            self._release(b)
        seq.host_block_table = [h for _, h in pairs]
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)
        return pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return need <= self.num_free_blocks

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Bring ``seq`` back with room for ``num_new_tokens``; returns ``(host, device)`` pairs."""
        pairs = [(h, self._pop_free()) for h in seq.host_block_table]
        self.host_free.extend(reversed(seq.host_block_table))
        seq.host_block_table = []
        seq.block_table = [d for _, d in pairs]
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._pop_free())
        return pairs

    # --- invariants ------------------------------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """Raise ``AssertionError`` unless the pool is consistent with the live sequences:
        free + used = total; a block is free iff its ref count is 0; each ref count equals the
        number of live block-table entries naming it; every cached hash names a block whose
        stored tokens (and parent) hash to it and match the tokens of every sequence using it;
        host blocks are conserved too."""
        refs = [0] * self.num_blocks
        host_used = []
        for seq in live:
            for b in seq.block_table:
                refs[b] += 1
            host_used += seq.host_block_table
            assert len(seq.block_table) >= self.blocks_for(seq.num_computed_tokens) or seq.host_block_table, (
                f"seq {seq.seq_id}: block table shorter than its computed tokens"
            )
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used + len(self.free_queue) == self.num_blocks, "free + used != total"
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]} references"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), (
                f"block {block.block_id}: free iff ref_count == 0 violated"
            )
        for h, b in self.hash_to_block.items():
            block = self.blocks[b]
            tokens = block.token_ids
            assert block.hash == h and tokens is not None and chain_hash(block.parent_hash, tokens) == h, (
                f"cached block {b}: hash does not match its stored tokens"
            )
        bs = self.block_size
        for seq in live:
            for i, b in enumerate(seq.block_table):
                block = self.blocks[b]
                if block.hash is not None:
                    assert seq.block_tokens(i * bs, (i + 1) * bs) == block.token_ids, (
                        f"seq {seq.seq_id} block {i}: cached tokens differ from the sequence's"
                    )
        assert len(host_used) == len(set(host_used)), "a host block is used twice"
        assert len(host_used) + len(self.host_free) == self.num_host_blocks, "host free + used != total"
