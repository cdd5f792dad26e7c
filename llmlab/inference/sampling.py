"""Sampling parameters and the per-sequence sampler.

Greedy (``temperature == 0``), temperature scaling, top-k (Fan et al. 2018) and nucleus / top-p
(Holtzman et al., ICLR 2020) sampling. Each sequence draws from its own ``torch.Generator``
(seeded from ``seed``, plus the sample index when ``n > 1``), so a seeded request produces the same
tokens whatever else shares its batch and however often it is preempted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How to generate for one request (names as in vLLM's ``SamplingParams``).

    - ``n``: independent samples of the same prompt (they share the prompt's KV blocks).
    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_k``: keep the k most likely tokens (0 or -1: all). ``top_p``: keep the smallest set
      of tokens whose probability reaches ``top_p`` (1.0: all).
    - ``seed``: per-request seed (None: drawn from the engine's seed sequence).
    - ``max_tokens``: at most this many generated tokens (>= 1).
    - ``stop``: strings that end generation; matched on the decoded text, also when split across
      tokens; the returned text ends before the stop string.
    - ``stop_token_ids``: token ids that end generation (kept in ``token_ids``, not in ``text``).
    - ``ignore_eos``: keep going past the model's end-of-sequence token.

    Raises ``ValueError`` naming the first out-of-range field.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1, 0 (all tokens) or a positive count")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens is None or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) % (2**63 - 1))
    return g


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits outside the top-k / top-p set to -inf. ``logits``: ``[V]`` fp32."""
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p (the first is always kept)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> int:
    """One token id from ``logits [V]`` (any float dtype) under ``params``."""
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits))
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
