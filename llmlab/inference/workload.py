"""The serving benchmark's workload and the KV-cache waste arithmetic.

- :func:`sharegpt_workload`: seeded ShareGPT-like requests (heavy-tailed prompt and output lengths).
- :func:`poisson_arrivals`: offline (all at 0) or Poisson arrival times.
- :func:`kv_waste`, :func:`trace_waste`, :func:`concurrent_trace`: the share of allocated KV slots
  holding no token when every sequence owns whole blocks (PagedAttention, Kwon et al. 2023 §2.3),
  for one step, averaged over a trace, and the trace an offline run would make.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable
from typing import Any


def sharegpt_workload(
    num_requests: int,
    *,
    seed: int = 0,
    max_len: int = 512,
    prompt_len_median: float = 32.0,
    output_len_median: float = 32.0,
    sigma: float = 0.9,
    vocab_size: int = 256,
) -> dict[str, list[Any]]:
    """A seeded ShareGPT-like workload: lognormal prompt and output lengths (median
    ``*_median`` tokens, shape ``sigma``: a heavy right tail, as the ShareGPT conversations vLLM
    benchmarks with), clipped so that prompt >= 4, output >= 2 and prompt + output <= ``max_len``.

    Prompts are consecutive bytes of the bundled corpus (byte vocabulary) or uniform token ids.
    Returns ``{"prompts": [[ids]], "prompt_lens": [...], "output_lens": [...]}``.
    Raises ``ValueError`` if ``num_requests < 1`` or ``max_len < 6``."""
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    if max_len < 6:
        raise ValueError(f"max_len={max_len} must be >= 6 (4 prompt + 2 output tokens)")
    rng = random.Random(seed)
    corpus = None
    if vocab_size == 256:
        from llmlab.data import load_corpus

        corpus = load_corpus().encode("utf-8")
    prompts, plens, olens = [], [], []
    for _ in range(num_requests):
        p = int(round(rng.lognormvariate(math.log(prompt_len_median), sigma)))
        p = max(4, min(p, max_len // 2))
        o = int(round(rng.lognormvariate(math.log(output_len_median), sigma)))
        o = max(2, min(o, max_len - p))
        if corpus is not None:
            s = rng.randrange(0, len(corpus) - p)
            ids = list(corpus[s : s + p])
        else:
            ids = [rng.randrange(vocab_size) for _ in range(p)]
        prompts.append(ids)
        plens.append(p)
        olens.append(o)
    return {"prompts": prompts, "prompt_lens": plens, "output_lens": olens}


def poisson_arrivals(num_requests: int, request_rate: float | None, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds: all 0 when ``request_rate`` is None or inf (offline), else a
    Poisson process of ``request_rate`` requests/s (exponential gaps), first at 0."""
    if request_rate is None or math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"request_rate={request_rate} must be > 0")
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for i in range(num_requests):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


def kv_waste(seq_lens: Collection[int], block_size: int) -> float:
    """Share of allocated KV slots holding no token when sequences of ``seq_lens`` tokens each
    own ``ceil(L / block_size)`` blocks (PagedAttention, Kwon et al. 2023 §2.3 / §4.2: only the
    last block of a sequence is partly empty). 0.0 for no sequences. About
    ``(block_size - 1) / 2 / (mean L + (block_size - 1) / 2)`` when lengths are spread evenly
    modulo ``block_size``: short sequences waste a larger share."""
    alloc = sum(-(-L // block_size) * block_size for L in seq_lens)
    return 0.0 if alloc == 0 else 1.0 - sum(seq_lens) / alloc


def trace_waste(step_seq_lens: Iterable[Collection[int]], block_size: int) -> float:
    """:func:`kv_waste` averaged over the steps of a trace (a list of per-step length lists) that
    held any sequence: the engine's ``kv_cache_waste_fraction`` recomputed at ``block_size``."""
    ws = [kv_waste(lens, block_size) for lens in step_seq_lens if lens]
    return sum(ws) / len(ws) if ws else 0.0


def concurrent_trace(prompt_lens: Collection[int], output_lens: Collection[int]) -> list[list[int]]:
    """The per-step cached lengths if every request runs from step 1 (offline, cache large
    enough): after step ``k`` a request with prompt ``p`` and output ``o > k`` holds ``p + k - 1``
    tokens (its newest sampled token is written at the next step)."""
    return [
        [p + k - 1 for p, o in zip(prompt_lens, output_lens) if o > k] for k in range(1, max(output_lens))
    ]


WASTE_BLOCK_SIZES = (1, 2, 4, 8, 16, 32)
