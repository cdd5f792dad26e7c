"""Serving metrics from per-request times: TTFT, TPOT, end-to-end latency, throughput.

Definitions (as in vLLM's ``benchmark_serving`` and the Orca / PagedAttention evaluations):

- TTFT (time to first token) = first-token time - arrival time, seconds.
- TPOT (time per output token) = (last-token time - first-token time) / (output tokens - 1),
  seconds; undefined for a one-token output (left out of the percentiles).
- end-to-end latency = last-token time - arrival time, seconds.
- throughput = generated tokens of all requests / (last finish - first arrival), tokens/s.

Percentiles interpolate linearly between order statistics (numpy's default ``"linear"`` method).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


def ttft(arrival: float, first_token: float | None) -> float | None:
    """Time to first token, seconds (None before the first token)."""
    return None if first_token is None else first_token - arrival


def tpot(first_token: float | None, finish: float | None, num_output_tokens: int) -> float | None:
    """Time per output token after the first, seconds; None for fewer than 2 tokens or before
    the finish."""
    if first_token is None or finish is None or num_output_tokens < 2:
        return None
    return (finish - first_token) / (num_output_tokens - 1)


@dataclass
class RequestTiming:
    """One request: ``arrival``, ``first_token``, ``finish`` in seconds (same clock),
    ``num_output_tokens`` generated tokens."""

    arrival: float
    first_token: float
    finish: float
    num_output_tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival  # ttft() with a first token, so never None

    @property
    def tpot(self) -> float | None:
        return tpot(self.first_token, self.finish, self.num_output_tokens)

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation.

    Raises ``ValueError`` for an empty list or ``q`` outside [0, 100]."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in [0, 100]")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def p50_p99(values: Iterable[float | None]) -> dict[str, float | None]:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"p50": None, "p99": None}
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99)}


def summarize(timings: list[RequestTiming]) -> dict[str, Any]:
    """``{"throughput_tokens_per_s", "ttft_s", "tpot_s", "e2e_s", "duration_s",
    "num_output_tokens"}`` over ``timings`` (each percentile entry is ``{"p50", "p99"}``)."""
    if not timings:
        raise ValueError("no requests to summarize")
    start = min(t.arrival for t in timings)
    end = max(t.finish for t in timings)
    tokens = sum(t.num_output_tokens for t in timings)
    dur = end - start
    return {
        "throughput_tokens_per_s": tokens / dur if dur > 0 else float("inf"),
        "ttft_s": p50_p99(t.ttft for t in timings),
        "tpot_s": p50_p99(t.tpot for t in timings),
        "e2e_s": p50_p99(t.e2e for t in timings),
        "duration_s": dur,
        "num_output_tokens": tokens,
    }
