"""Iteration-level scheduling (Orca, Yu et al., OSDI 2022) over a paged KV cache (vLLM).

Every engine step the scheduler decides which sequences advance and by how many tokens:

1. **Running** sequences first, in FCFS order: each gets its remaining uncomputed tokens (1 when
   decoding; the rest of a prompt chunk with chunked prefill), within the step's token budget
   ``max_num_batched_tokens``. If the block pool cannot hold them, the *latest-arrived* running
   sequence is preempted (vLLM §4.5): by **recompute** (its blocks are freed, its tokens go back
   to the waiting queue and are recomputed as a longer prompt) or by **swap** (its blocks are
   copied to host memory; a sequence sharing blocks is recomputed instead).
2. If nothing was preempted: **swapped** sequences come back first, then **waiting** ones, FCFS,
   up to ``max_num_seqs`` running sequences. A waiting sequence first takes over its cached
   prefix blocks (prefix caching), then asks for the rest; without chunked prefill its whole
   remaining prompt must fit the budget, with chunked prefill it takes what is left of it.

A sequence only tracks ``num_computed_tokens`` (vLLM v1), so all of these are one mechanism.
Pure Python: the returned :class:`SchedulerOutput` is what the model runner needs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmlab.inference.block_manager import BlockManager
from llmlab.inference.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    """Budgets. ``max_num_batched_tokens``: tokens computed per step (all sequences together).
    ``preemption_mode``: ``"recompute"`` or ``"swap"`` (swap needs host blocks)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"

    def validate(self) -> "SchedulerConfig":
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be 'recompute' or 'swap'")
        return self


@dataclass
class SchedulerOutput:
    """One step's plan. ``scheduled``: ``(sequence, num_new_tokens)`` in batch order; the K/V
    block copies to run before the forward: ``copies`` (copy-on-write, device to device),
    ``swap_out`` (device block, host block), ``swap_in`` (host block, device block)."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config.validate()
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0

    # --- queues ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def live_sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.swapped) + list(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and return all its blocks to the pool (also used for abort)."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.bm.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def _sort_running(self) -> None:
        self.running.sort(key=lambda s: (s.arrival_time, s.seq_id))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap" and self.bm.can_swap_out(seq):
            out.swap_out += self.bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            seq.num_preemptions += 1
            self.swapped.appendleft(seq)
        else:
            self.bm.free(seq)
            seq.reset_for_recompute()
            self.waiting.appendleft(seq)

    # --- the step ----------------------------------------------------------------------------
    def schedule(self, in_flight: frozenset[int] = frozenset()) -> SchedulerOutput:
        """The next step's plan. ``in_flight``: ids of running sequences whose previous step has
        not come back yet (a pipeline keeps several steps in flight, vLLM's virtual engines):
        they are neither scheduled nor preempted, but count towards ``max_num_seqs``."""
        if not in_flight:
            return self._schedule(0)
        held = [s for s in self.running if s.seq_id in in_flight]
        self.running = [s for s in self.running if s.seq_id not in in_flight]
        try:
            return self._schedule(len(held))
        finally:
            self.running += held
            self._sort_running()

    def _schedule(self, num_held: int) -> SchedulerOutput:
        cfg, bm, out = self.config, self.bm, SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.copies += bm.allocate(seq, num_new)
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        if out.preempted:
            return out
        while self.swapped and budget > 0 and len(self.running) + num_held < cfg.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_swap_in(seq, num_new):
                break
            self.swapped.popleft()
            out.swap_in += bm.swap_in(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        while self.waiting and not self.swapped and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + num_held + seq.pending_fork > cfg.max_num_seqs:
                break
            hits = bm.lookup_prefix(seq)
            computed = len(hits) * bm.block_size if hits else seq.num_computed_tokens
            num_new = seq.num_tokens - computed
            if num_new > budget:
                # A sequence resumed after preemption may have outgrown the budget: it is
                # recomputed in chunks even without chunked prefill, or it would wait forever.
                if not cfg.enable_chunked_prefill and not seq.num_preemptions:
                    break
                num_new = budget
            if not bm.can_allocate(seq, num_new, hits):
                break
            self.waiting.popleft()
            out.copies += bm.allocate(seq, num_new, hits)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        self._sort_running()
        return out

    def update(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens now have K/V in the cache."""
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)

    def fork(self, seq: Sequence, n: int) -> list[Sequence]:
        """Split a sequence whose prompt is computed into ``n`` samples sharing its blocks."""
        children = []
        for k in range(1, n):
            child = seq.fork(k)
            self.bm.fork(seq, child)
            children.append(child)
        seq.pending_fork = 1
        self.running.extend(children)
        self._sort_running()
        return children
