"""Checks for the lab 11 exercises (:mod:`llmlab.solutions.lab11`)."""

from __future__ import annotations

import math
import random

from llmlab.check._base import _fail, _ok
from llmlab.serve.router import Router
from llmlab.solutions import lab11 as ex


def least_loaded(fn) -> bool:
    name = "least_loaded"
    cases = [
        ([3, 1, 2], 0),
        ([0, 0, 0, 0], 2),
        ([2, 0, 5, 0], 2),
        ([1, 1], 1),
        ([4], 0),
        ([0, 3, 0], 0),
        ([2, 2, 1, 1], 3),
    ]
    for loads, start in cases:
        want, got = ex.least_loaded(loads, start), fn(list(loads), start)
        if got != want:
            hint = (
                "the smallest load wins"
                if loads[got if isinstance(got, int) and 0 <= got < len(loads) else 0] != min(loads)
                else "equal loads: go round from `start` (start, start+1, ..., then wrap to 0), "
                "so idle replicas take turns"
            )
            _fail(name, f"loads={loads}, start={start}", want, got, hint)
    routed_want, routed_got = _routed(ex.least_loaded), _routed(fn)
    if routed_got != routed_want:
        _fail(
            name,
            "as a Router's policy: replicas picked for 6 requests arriving on 3 idle "
            "replicas, each staying in flight",
            routed_want,
            routed_got,
            "the router passes start = the replica after the last one picked; with equal loads "
            "go round from there.",
        )
    return _ok(name, "smallest load, ties round-robin from start; as a Router's policy")


class _Replica:
    """What a Router reads of a replica: whether it runs and its requests in flight."""

    is_running = True

    def __init__(self):
        self.num_in_flight = 0


def _routed(policy) -> list[int]:
    replicas = [_Replica() for _ in range(3)]
    router, picked = Router(replicas, policy=policy), []
    for _ in range(6):
        r = router.pick()
        r.num_in_flight += 1
        picked.append(replicas.index(r))
    return picked


_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)  # vLLM v1's (llmlab.serve.metrics.TTFT_BUCKETS)


def _buckets(seed: int, n: int) -> list[tuple[float, float]]:
    """A TTFT histogram with vLLM's bucket bounds, filled with ``n`` lognormal latencies."""
    rng = random.Random(seed)
    xs = [rng.lognormvariate(math.log(0.05), 1.0) for _ in range(n)]
    bounds = list(_TTFT_BUCKETS) + [math.inf]
    return [(b, float(sum(1 for x in xs if x <= b))) for b in bounds]


def histogram_quantile(fn) -> bool:
    name = "histogram_quantile"
    cases = [
        (0.5, [(0.1, 2.0), (0.2, 6.0), (math.inf, 8.0)]),
        (0.99, [(0.1, 2.0), (0.2, 6.0), (math.inf, 8.0)]),  # lands in +inf
        (0.25, [(1.0, 4.0), (2.0, 4.0), (math.inf, 4.0)]),
        (0.9, [(0.5, 0.0), (1.0, 0.0), (math.inf, 0.0)]),
    ]  # no observations
    cases += [(q, _buckets(s, 200)) for q, s in ((0.5, 0), (0.99, 1), (0.9, 2))]
    for q, b in cases:
        want, got = ex.histogram_quantile(q, b), fn(q, [tuple(x) for x in b])
        same = isinstance(got, (int, float)) and (
            (math.isnan(want) and math.isnan(got)) or math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)
        )
        if not same:
            if math.isnan(want):
                hint = "with no observations there is no percentile: return float('nan')."
            elif math.isinf(next(bd for bd, c in b if c >= q * b[-1][1])):
                hint = "the rank falls in the +Inf bucket: return the largest finite bound."
            else:
                hint = (
                    "rank = q * total; in the first bucket whose cumulative count reaches it, "
                    "interpolate: lower + (upper - lower) * (rank - count below) / count in bucket; "
                    "the first bucket's lower bound is 0."
                )
            _fail(name, f"q={q}, buckets={b}", want, got, hint)
    return _ok(name, "PromQL's histogram_quantile on hand-made and vLLM-bucketed histograms")


def _requests(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        send = rng.uniform(0, 3)
        first = send + rng.expovariate(5.0)
        k = 1 if i == 0 else rng.randint(2, 30)
        out.append(
            {
                "send": send,
                "first_token": first,
                "num_output_tokens": k,
                "finish": first + (k - 1) * rng.uniform(0.005, 0.06),
            }
        )
    return out


def goodput(fn) -> bool:
    name = "goodput"
    for seed, ttft, tpot in ((0, 0.2, 0.03), (1, None, 0.02), (2, 0.1, None), (3, None, None)):
        reqs = _requests(seed, 30)
        want, got = ex.goodput(reqs, ttft, tpot), fn([dict(r) for r in reqs], ttft, tpot)
        if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-9):
            _fail(
                name,
                f"30 requests (seed {seed}; request 0 generated one token), "
                f"slo_ttft={ttft}, slo_tpot={tpot}: good requests per second",
                want,
                got,
                "a request counts when TTFT <= slo_ttft AND TPOT <= slo_tpot (a one-token "
                "request has no TPOT and passes; a None objective always passes); divide by the "
                "span from the first send to the last finish.",
            )
    return _ok(name, "goodput under TTFT/TPOT objectives on four workloads")
