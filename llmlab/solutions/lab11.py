"""Lab 11 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

import math


def least_loaded(loads: list[int], start: int = 0) -> int:
    """Lab 11. The data-parallel router: which replica gets the next request.

    ``loads[i]``: requests in flight on replica ``i`` (admitted, not finished). Return the index of
    the smallest load; among replicas with that load, the first one found going round from index
    ``start`` (``start, start + 1, ..., n - 1, 0, 1, ...``), so that idle replicas take turns
    instead of replica 0 getting every request of a quiet period. (vLLM's data-parallel balancer
    and llmlab's ``llmlab.serve.router`` route on queue lengths the same way; a
    ``Router(engines, policy=least_loaded)`` calls it for every request.)
    """
    n = len(loads)
    best = start % n
    for k in range(1, n):
        i = (start + k) % n
        if loads[i] < loads[best]:
            best = i
    return best


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Lab 11. A latency percentile from a Prometheus histogram, as PromQL's ``histogram_quantile``.

    ``buckets``: ``(upper_bound, cumulative_count)`` sorted by bound, the last bound ``inf`` (what
    ``/metrics`` exports as ``..._bucket{le="..."}``); ``q`` in [0, 1] (0.99 for P99). Let ``rank =
    q * total`` (total = the ``inf`` bucket's count) and take the first bucket whose cumulative count
    is >= rank. Interpolate linearly inside it: ``lower + (upper - lower) * (rank - count below) /
    (count in the bucket)``, where ``lower`` is the previous bucket's bound (0 for the first bucket).
    If that bucket is the ``inf`` one, return the largest finite bound. No observations: ``nan``.
    """
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def goodput(requests: list[dict], slo_ttft: float | None, slo_tpot: float | None) -> float:
    """Lab 11. Goodput: requests per second that met the service-level objectives (DistServe,
    Zhong et al. OSDI 2024; vLLM's ``--goodput``; ``llmlab bench serve --slo-ttft/--slo-tpot``).

    ``requests``: one dict per completed request with ``send``, ``first_token``, ``finish``
    (seconds, one clock) and ``num_output_tokens``. A request is good when its TTFT (first token -
    send) is <= ``slo_ttft`` and its TPOT ((finish - first token) / (output tokens - 1)) is <=
    ``slo_tpot``; a one-token request has no TPOT and passes that objective; an objective that is
    None always passes. Return good requests / (last finish - first send).
    """
    good = 0
    for r in requests:
        ttft = r["first_token"] - r["send"]
        tpot = (
            None
            if r["num_output_tokens"] < 2
            else (r["finish"] - r["first_token"]) / (r["num_output_tokens"] - 1)
        )
        if (slo_ttft is None or ttft <= slo_ttft) and (slo_tpot is None or tpot is None or tpot <= slo_tpot):
            good += 1
    span = max(r["finish"] for r in requests) - min(r["send"] for r in requests)
    return good / span


EXERCISES = [least_loaded, histogram_quantile, goodput]
