"""Sampling parameters, the logits processors and the per-sequence sampler (vLLM's names and
semantics).

A token is chosen from the model's logits in this order (vLLM's sampler):

1. ``min_tokens``: until that many tokens are generated, EOS and the stop token ids are masked;
   then ``logit_bias`` (OpenAI's: ``{token id: bias in [-100, 100]}``) is added.
2. Penalties: ``repetition_penalty`` over prompt and output tokens (Keskar et al. 2019, CTRL:
   a positive logit is divided by it, a negative one multiplied), then ``frequency_penalty`` x
   (count in the output) and ``presence_penalty`` x (in the output at all) subtracted (OpenAI).
3. Greedy (``temperature == 0``): the argmax. Otherwise divide by ``temperature``, drop tokens
   below ``min_p`` x the top probability (Nguyen et al. 2024), keep the top-k (Fan et al. 2018)
   and the nucleus / top-p (Holtzman et al., ICLR 2020), and draw.

Every float field must be finite and inside its range (:data:`RANGES`); a non-zero
``temperature`` below :data:`MIN_TEMPERATURE` (e.g. a denormal 1e-40, which would overflow the
logits to inf) is refused like a NaN, naming the field.

``logprobs`` (and ``prompt_logprobs``) are the model's raw log-softmax (before any of the above, vLLM's default
``raw_logprobs``). Each sequence draws from its own ``torch.Generator`` (seeded from ``seed``, plus
the sample index when ``n > 1``), so a seeded request produces the same tokens whatever else
shares its batch and however often it is preempted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# Fields a checkpoint's generation_config.json may fill when a request leaves them unset, with
# the value used when neither sets them (vLLM's defaults).
DEFAULTS = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "max_tokens": 16,
}

MIN_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS; below it (but 0) refused: use 0 for greedy
# field -> (lowest, highest) allowed, both finite and inclusive
RANGES = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 100.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
MAX_LOGIT_BIAS = 100.0  # the OpenAI API's range for a logit_bias value


def _check_float(name: str, v: object, lo: float, hi: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name}={v!r} must be a number")
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{name}={v} must be a finite number in [{lo:g}, {hi:g}]")


def filled(v: T | None, name: str) -> T:
    """``v``, a :data:`DEFAULTS` field that :class:`SamplingParams` filled at construction; raises
    ``ValueError`` naming the field when it was set back to None since."""
    if v is None:
        raise ValueError(f"{name}=None: SamplingParams fills it at construction; set a value, not None")
    return v


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
      the sampled one) at every generated position (None: none). ``prompt_logprobs``: the same
      at every prompt position (the first has none: vLLM's ``prompt_logprobs``).
    - ``logit_bias``: ``{token id: bias}`` added to the logits (OpenAI; bias in [-100, 100]).
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
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    _unset: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        unset = {k for k in DEFAULTS if getattr(self, k) is None}
        self._unset = frozenset(unset)
        for k in unset:
            setattr(self, k, DEFAULTS[k])
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.logit_bias:
            try:
                self.logit_bias = {int(t): b for t, b in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError("logit_bias must map token ids to numbers") from None
        self.validate()

    def validate(self) -> "SamplingParams":
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name}={v!r} must be an integer")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        for name, (lo, hi) in RANGES.items():
            _check_float(name, getattr(self, name), lo, hi)
        temperature, top_k = filled(self.temperature, "temperature"), filled(self.top_k, "top_k")
        max_tokens = filled(self.max_tokens, "max_tokens")
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature} must be 0 (greedy) or in "
                f"[{MIN_TEMPERATURE:g}, {RANGES['temperature'][1]:g}]"
            )
        if top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1, 0 (all tokens) or a positive count")
        if self.top_p == 0.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not 0 <= self.min_tokens <= max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name}={v!r} must be an integer >= 0 or None")
        if any(not isinstance(s, str) or not s for s in self.stop or ()):
            raise ValueError("stop strings must be non-empty strings")
        for t, b in (self.logit_bias or {}).items():
            _check_float(f"logit_bias[{t}]", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        return self

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` for ``stop_token_ids`` or ``logit_bias`` ids outside [0, V)."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or ())),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name}: token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")

    def is_set(self, name: str) -> bool:
        """Whether ``name`` was given (not left to the defaults)."""
        return name not in self._unset

    def with_defaults(self, defaults: dict[str, Any]) -> tuple["SamplingParams", dict[str, Any]]:
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


def make_generator(seed: int, device: str | torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) % (2**63 - 1))
    return g


# --- logits processors (each [V] fp32 -> [V]) --------------------------------------------------
def apply_min_tokens(
    logits: torch.Tensor, num_output_tokens: int, min_tokens: int, stop_ids: Iterable[int]
) -> torch.Tensor:
    """Mask ``stop_ids`` (EOS and stop token ids) to -inf while ``num_output_tokens < min_tokens``
    (HF's ``MinNewTokensLengthLogitsProcessor``)."""
    ids = [t for t in stop_ids if 0 <= t < logits.shape[-1]]
    if num_output_tokens >= min_tokens or not ids:
        return logits
    logits = logits.clone()
    logits[ids] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, float] | None) -> torch.Tensor:
    """``logits[t] += bias`` for each ``{t: bias}`` of ``logit_bias`` (OpenAI's ``logit_bias``)."""
    if not logit_bias:
        return logits
    ids = torch.tensor(list(logit_bias), dtype=torch.long)
    bias = torch.tensor(list(logit_bias.values()), dtype=logits.dtype)
    return logits.index_add(0, ids, bias)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Iterable[int],
    output_ids: Collection[int],
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> torch.Tensor:
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


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Iterable[int],
    output_ids: Collection[int],
    stop_ids: Iterable[int],
) -> torch.Tensor:
    """Steps 1-2 of the module docstring: ``min_tokens`` masking and ``logit_bias``, then the
    penalties. ``logits`` ``[V]`` (any float dtype) -> fp32 ``[V]``."""
    logits = apply_min_tokens(logits.float(), len(output_ids), params.min_tokens, stop_ids)
    logits = apply_logit_bias(logits, params.logit_bias)
    return apply_penalties(
        logits,
        prompt_ids,
        output_ids,
        filled(params.repetition_penalty, "repetition_penalty"),
        params.presence_penalty,
        params.frequency_penalty,
    )


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from (processed) ``logits [V]`` under ``params``: step 3."""
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits))
    temperature, min_p = filled(params.temperature, "temperature"), filled(params.min_p, "min_p")
    logits = apply_min_p(logits / temperature, min_p)
    logits = filter_logits(logits, filled(params.top_k, "top_k"), filled(params.top_p, "top_p"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: torch.Tensor, token_id: int, k: int) -> dict[int, tuple[float, int]]:
    """``{token: (logprob, rank)}`` of the ``k`` most likely tokens and of ``token_id`` under the
    raw log-softmax of ``logits [V]`` (rank 1 = most likely), as vLLM returns them."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out: dict[int, tuple[float, int]] = {}
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        out = {int(t): (float(v), r + 1) for r, (v, t) in enumerate(zip(vals, ids))}
    if token_id not in out:
        out[token_id] = (float(lp[token_id]), int((lp > lp[token_id]).sum()) + 1)
    return out
