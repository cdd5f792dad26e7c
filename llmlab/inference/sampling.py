"""Sampling parameters, the logits processors and the per-sequence sampler (vLLM's names and
semantics).

A token is chosen from the model's logits in this order (vLLM's sampler):

1. ``min_tokens``: until that many tokens are generated, EOS and the stop token ids are masked.
2. Penalties: ``repetition_penalty`` over prompt and output tokens (Keskar et al. 2019, CTRL:
   a positive logit is divided by it, a negative one multiplied), then ``frequency_penalty`` x
   (count in the output) and ``presence_penalty`` x (in the output at all) subtracted (OpenAI).
3. Greedy (``temperature == 0``): the argmax. Otherwise divide by ``temperature``, drop tokens
   below ``min_p`` x the top probability (Nguyen et al. 2024), keep the top-k (Fan et al. 2018)
   and the nucleus / top-p (Holtzman et al., ICLR 2020), and draw.

``logprobs`` are the model's raw log-softmax (before any of the above, vLLM's default
``raw_logprobs``). Each sequence draws from its own ``torch.Generator`` (seeded from ``seed``, plus
the sample index when ``n > 1``), so a seeded request produces the same tokens whatever else
shares its batch and however often it is preempted.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

# Fields a checkpoint's generation_config.json may fill when a request leaves them unset, with
# the value used when neither sets them (vLLM's defaults).
DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_tokens": 16}


@dataclass
class SamplingParams:
    """How to generate for one request (names and meaning as in vLLM's ``SamplingParams``).

    - ``n``: independent samples of the same prompt (they share the prompt's KV blocks).
    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_k``: keep the k most likely tokens (0 or -1: all). ``top_p``: keep the smallest set
      of tokens whose probability reaches ``top_p`` (1.0: all). ``min_p``: drop tokens whose
      probability is below ``min_p`` x the most likely one's (0: none).
    - ``repetition_penalty`` (> 0, 1 = off) over prompt and output tokens; ``presence_penalty``
      and ``frequency_penalty`` (in [-2, 2], 0 = off) over output tokens.
    - ``seed``: per-request seed (None: drawn from the engine's seed sequence).
    - ``max_tokens``: at most this many generated tokens (>= 1). ``min_tokens``: EOS and stop
      token ids cannot end generation before this many (stop strings neither).
    - ``stop``: strings that end generation; matched on the detokenised output text, also when
      split across tokens; the text ends before the stop string unless
      ``include_stop_str_in_output`` (which also keeps a stop token's text).
    - ``stop_token_ids``: token ids that end generation (kept in ``token_ids``, not in ``text``).
    - ``ignore_eos``: keep going past the model's end-of-sequence token.
    - ``logprobs``: return the log-probabilities of the ``logprobs`` most likely tokens (and of
      the sampled one) at every generated position (None: none).
    - ``skip_special_tokens``: leave special tokens out of the text.

    Fields in :data:`DEFAULTS` left unset (None) are filled from the checkpoint's
    ``generation_config.json`` when the engine has one, else from :data:`DEFAULTS`;
    :meth:`is_set` tells which were given. Raises ``ValueError`` naming the first out-of-range
    field.
    """

    n: int = 1
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    _unset: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self):
        unset = {k for k in DEFAULTS if getattr(self, k) is None}
        self._unset = frozenset(unset)
        for k in unset:
            setattr(self, k, DEFAULTS[k])
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.validate()

    def validate(self) -> "SamplingParams":
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1, 0 (all tokens) or a positive count")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be in [0, max_tokens="
                             f"{self.max_tokens}]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs={self.logprobs} must be >= 0 or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        return self

    def is_set(self, name: str) -> bool:
        """Whether ``name`` was given (not left to the defaults)."""
        return name not in self._unset

    def with_defaults(self, defaults: dict) -> tuple["SamplingParams", dict]:
        """A copy whose unset fields take ``defaults`` (e.g. a checkpoint's generation config;
        keys outside :data:`DEFAULTS` are ignored), and the ``{field: value}`` actually used."""
        used = {k: v for k, v in defaults.items() if k in self._unset}
        if not used:
            return self, {}
        new = dataclasses.replace(self, **used)
        new._unset = self._unset - set(used)
        return new, used

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) % (2**63 - 1))
    return g


# --- logits processors (each [V] fp32 -> [V]) --------------------------------------------------
def apply_min_tokens(logits: torch.Tensor, num_output_tokens: int, min_tokens: int,
                     stop_ids) -> torch.Tensor:
    """Mask ``stop_ids`` (EOS and stop token ids) to -inf while ``num_output_tokens < min_tokens``
    (HF's ``MinNewTokensLengthLogitsProcessor``)."""
    ids = [t for t in stop_ids if 0 <= t < logits.shape[-1]]
    if num_output_tokens >= min_tokens or not ids:
        return logits
    logits = logits.clone()
    logits[ids] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, prompt_ids, output_ids, repetition_penalty: float = 1.0,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> torch.Tensor:
    """vLLM's penalties: ``repetition_penalty`` on every token of prompt or output (divide a
    positive logit, multiply a negative one: HF's ``RepetitionPenaltyLogitsProcessor``), then
    ``logit -= frequency_penalty * count_in_output + presence_penalty * (count_in_output > 0)``."""
    V = logits.shape[-1]
    if repetition_penalty != 1.0:
        seen = torch.zeros(V, dtype=torch.bool)
        seen[torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long)] = True
        pen = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, pen, logits)
    if (presence_penalty or frequency_penalty) and len(output_ids):
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=V)
        counts = counts[:V].to(logits.dtype)
        logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Set to -inf the tokens whose probability is below ``min_p`` x the largest (HF's
    ``MinPLogitsWarper``; the most likely token always stays)."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


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


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids, output_ids,
                   stop_ids) -> torch.Tensor:
    """Steps 1-2 of the module docstring: ``min_tokens`` masking, then the penalties. ``logits``
    ``[V]`` (any float dtype) -> fp32 ``[V]``."""
    logits = apply_min_tokens(logits.float(), len(output_ids), params.min_tokens, stop_ids)
    return apply_penalties(logits, prompt_ids, output_ids, params.repetition_penalty,
                           params.presence_penalty, params.frequency_penalty)


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> int:
    """One token id from (processed) ``logits [V]`` under ``params``: step 3."""
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits))
    logits = apply_min_p(logits / params.temperature, params.min_p)
    logits = filter_logits(logits, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: torch.Tensor, token_id: int, k: int) -> dict[int, tuple[float, int]]:
    """``{token: (logprob, rank)}`` of the ``k`` most likely tokens and of ``token_id`` under the
    raw log-softmax of ``logits [V]`` (rank 1 = most likely), as vLLM returns them."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {}
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        out = {int(t): (float(v), r + 1) for r, (v, t) in enumerate(zip(vals, ids))}
    if token_id not in out:
        out[token_id] = (float(lp[token_id]), int((lp > lp[token_id]).sum()) + 1)
    return out
