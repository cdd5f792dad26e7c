"""What the engine reports: per-request outputs and timings, per-step metrics.

:class:`RequestOutput` (one per request, with a :class:`CompletionOutput` per sample) is what
``LLMEngine.step``, ``LLM.generate`` and ``LLM.stream`` return, with the names of vLLM's outputs.
:class:`RequestMetrics` holds a request's times, :class:`StepMetrics` one engine step; TTFT and
TPOT are those of :mod:`llmlab.inference.metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmlab.inference import metrics


@dataclass
class RequestMetrics:
    """Times in seconds (``time.perf_counter``). ``ttft`` = first token - arrival; ``tpot`` =
    (finish - first token) / (output tokens - 1) of the longest sample."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_prefix_cached_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return metrics.ttft(self.arrival_time, self.first_token_time)

    @property
    def tpot(self) -> float | None:
        return metrics.tpot(self.first_token_time, self.finish_time, self.num_output_tokens)

    def timing(self) -> metrics.RequestTiming:
        """A finished request's :class:`~llmlab.inference.metrics.RequestTiming` (what
        :func:`~llmlab.inference.metrics.summarize` takes). Raises ``ValueError`` when it has no
        first token or no finish time yet."""
        first, finish = self.first_token_time, self.finish_time
        if first is None or finish is None:
            raise ValueError(f"a request without a first token ({first}) or finish ({finish}) has no timing")
        return metrics.RequestTiming(self.arrival_time, first, finish, self.num_output_tokens)


@dataclass
class Logprob:
    """One token's log-probability under the model's raw log-softmax, its rank (1 = most likely)
    and its text (vLLM's ``Logprob``)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample. ``text``: ``decode(prompt + token_ids) - decode(prompt)`` (None without a
    tokenizer); while streaming, only text that can no longer change. ``logprobs`` (when
    requested): per generated token ``{token_id: Logprob}`` of the top ``logprobs`` tokens and the
    sampled one; ``cumulative_logprob`` their sum over the sampled tokens."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # None while running, then "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """A request's state. ``error``: why it failed (``finish_reason == "error"``: a bad request,
    or non-finite logits), else None. ``sampling_defaults``: the fields the checkpoint's
    generation config filled because the request left them unset. ``prompt_logprobs`` (when
    requested): per prompt token ``{token_id: Logprob}`` of the top K and the actual token, None
    for the first (vLLM's)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def error_output(request_id: str, prompt: object, message: str, now: float) -> RequestOutput:
    """The finished output of a request refused before it ran (``finish_reason="error"``)."""
    text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
    text = text if isinstance(text, str) else None
    return RequestOutput(
        str(request_id),
        text,
        [],
        [CompletionOutput(0, [], None, "error")],
        True,
        RequestMetrics(now, finish_time=now),
        error=message,
    )


@dataclass
class StepMetrics:
    """One engine step. Times in seconds; ``kv_tokens_stored`` counts the cache slots holding a
    computed token (shared blocks once), so ``1 - kv_tokens_stored / (kv_blocks_used *
    block_size)`` is the fraction of allocated KV memory that is wasted (PagedAttention, Kwon et
    al. 2023 §2.3: slots allocated but holding no token's K/V; the engine allocates a block only
    when a token is about to be written into it, so this is the internal fragmentation of each
    sequence's last block, nothing reserved ahead; blocks kept for the prefix cache after their
    sequence finished are free, not counted). ``seq_lens``: cached tokens of each running sequence
    after the step (what the waste at another block size would be computed from). ``sample_s``:
    seconds spent drawing this step's tokens from the logits (temperature, top-k/p)."""

    step: int
    start_time: float
    duration_s: float
    num_seqs: int  # batch size: sequences computed this step
    num_batched_tokens: int
    num_prefill_tokens: int  # tokens of sequences that computed more than one token
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int  # preempted in this step
    kv_blocks_used: int
    kv_blocks_total: int
    kv_tokens_stored: int
    block_size: int
    num_cow_copies: int
    num_prefix_hit_tokens: int  # cumulative
    seq_lens: tuple[int, ...] = ()
    sample_s: float = 0.0

    @property
    def kv_waste_fraction(self) -> float:
        alloc = self.kv_blocks_used * self.block_size
        return 0.0 if alloc == 0 else 1.0 - self.kv_tokens_stored / alloc
