"""Request state: the tokens of one sequence, how many of them have K/V in the cache, and where.

The central idea of vLLM v1 (Kwon et al., SOSP 2023; vLLM v1 scheduler) is that a sequence only
tracks ``num_computed_tokens``: the tokens whose keys and values already sit in the paged cache.
Each step the scheduler hands a sequence ``k`` more tokens to compute. A fresh prompt (prefill),
a chunk of a long prompt (chunked prefill), a prompt whose first blocks were found in the prefix
cache, a sequence resumed after preemption, and a decode step (``k = 1``) are then the same thing.

Pure Python: nothing here knows about torch.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the engine's opaque slots below: typed for the checker, never imported here
    import torch

    from llmlab.inference.detokenizer import IncrementalDetokenizer
    from llmlab.inference.multimodal import MultimodalState
    from llmlab.inference.outputs import Logprob
    from llmlab.inference.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new, or preempted by recompute)
    RUNNING = "running"  # holds blocks in the device cache
    SWAPPED = "swapped"  # preempted by swapping its blocks to host memory
    FINISHED = "finished"  # done (stop, length or abort); owns no blocks


_seq_counter = itertools.count()


class StopStrings(Protocol):
    """A sequence's stop-string matcher (:class:`~llmlab.inference.stop_checker.StopMatcher`)."""

    @property
    def held(self) -> int: ...

    def feed(self, text: str, start: int, report: bool = True) -> tuple[int, str] | None: ...


# What names a block's tokens in the prefix cache (Sequence.block_tokens): the token ids, then for
# a prompt with images each overlapping image's (content hash, offset) key.
BlockTokens = tuple[int | tuple[str, int], ...]


@dataclass
class Sequence:
    """One generated sample. A request with ``n > 1`` is forked into ``n`` sequences after its
    prompt is computed (they share the prompt's blocks; see :meth:`BlockManager.fork`).

    ``token_ids`` is prompt + output. ``block_table[i]`` is the physical block holding tokens
    ``[i * block_size, (i + 1) * block_size)``. ``num_computed_tokens`` counts the leading tokens
    whose K/V is in the cache (``0 <= num_computed_tokens <= len(token_ids)``).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    sample_index: int = 0  # which of the request's n samples this is
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)  # while SWAPPED
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    pending_fork: int = 1  # > 1: fork into this many samples after the prompt
    num_preemptions: int = 0
    num_prefix_cached_tokens: int = 0  # tokens found in the prefix cache at admission
    skip_prefix_cache: bool = False  # compute every prompt token (its prompt logprobs)
    lora_id: int = 0  # the LoRA adapter it runs with (0: the base; inference/lora.py)
    # Timestamps (seconds, time.perf_counter): first_scheduled/first_token/finish.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Opaque slots for the engine: a torch.Generator, the incremental detokenizer, the stop
    # strings' matcher and the text shown, the log-probabilities of each generated position.
    generator: torch.Generator | None = None
    seed: int = 0
    detokenizer: IncrementalDetokenizer | None = None
    stop_matcher: StopStrings | None = None
    text: str = ""
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Images in the prompt (llmlab.inference.multimodal.MultimodalState) or None: their spans
    # name the prompt's blocks for prefix caching (block_tokens) and their M-RoPE positions.
    mm: MultimodalState | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    # --- views -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_tokens(self, start: int, end: int) -> BlockTokens:
        """What names tokens ``[start, end)`` in the prefix cache: their ids, and for a prompt
        with images each overlapping image's content hash (``mm.block_key``)."""
        toks = tuple(self.token_ids[start:end])
        return toks if self.mm is None else toks + self.mm.block_key(start, end)

    # --- transitions -------------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the cache entries are dropped; the tokens (prompt and output
        so far) are kept and will be recomputed as one long prompt when the sequence resumes."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def fork(self, sample_index: int) -> "Sequence":
        """A copy sharing every token so far (the caller shares the blocks and ref-counts them)."""
        child = Sequence(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            self.arrival_time,
            sample_index=sample_index,
            token_ids=list(self.token_ids),
            num_computed_tokens=self.num_computed_tokens,
            block_table=list(self.block_table),
            status=self.status,
            pending_fork=1,
            num_prefix_cached_tokens=self.num_prefix_cached_tokens,
            first_scheduled_time=self.first_scheduled_time,
            mm=self.mm,
            lora_id=self.lora_id,
        )
        return child
