"""Lab 11's exercise checks fail, in plain words, on realistic wrong answers; the references agree
with what llmlab itself computes (the serve router, prometheus_client's histogram buckets)."""

import math

import pytest

from llmlab import check, exercises
from llmlab.check import ExerciseFailed
from llmlab.inference.metrics import RequestTiming


def _first_minimum(loads, start):  # ignores start: replica 0 takes every idle request
    return loads.index(min(loads))


def _no_interpolation(q, buckets):  # returns the bucket's upper bound
    total = buckets[-1][1]
    return next(b for b, c in buckets if c >= q * total) if total else math.nan


def _inf_bucket_is_inf(q, buckets):
    total = buckets[-1][1]
    if total and q * total > buckets[-2][1]:
        return math.inf
    return exercises.histogram_quantile(q, buckets)


def _goodput_counts_one_token_as_bad(reqs, ttft, tpot):
    ok = [r for r in reqs if r["num_output_tokens"] > 1 or tpot is None]
    return (
        exercises.goodput(ok, ttft, tpot)
        * (max(r["finish"] for r in ok) - min(r["send"] for r in ok))
        / (max(r["finish"] for r in reqs) - min(r["send"] for r in reqs))
    )


def _goodput_divides_by_count(reqs, ttft, tpot):
    return (
        exercises.goodput(reqs, ttft, tpot)
        * (max(r["finish"] for r in reqs) - min(r["send"] for r in reqs))
        / len(reqs)
    )


WRONG = [
    ("least_loaded", _first_minimum, "idle replicas take turns"),
    ("histogram_quantile", _no_interpolation, "interpolate"),
    ("histogram_quantile", _inf_bucket_is_inf, "largest finite bound"),
    ("goodput", _goodput_counts_one_token_as_bad, "one-token"),
    ("goodput", _goodput_divides_by_count, "divide by the span"),
]


@pytest.mark.parametrize("name,wrong,words", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_wrong_answer_is_explained(name, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(wrong)
    assert words in str(info.value) and "expected:" in str(info.value)


def test_references_agree_with_llmlab():
    from llmlab.serve.router import least_loaded

    for loads in ([0, 0, 0], [3, 1, 1, 0], [2, 2, 5, 1, 1]):
        for start in range(len(loads)):
            assert exercises.least_loaded(loads, start) == least_loaded(loads, start)
    import prometheus_client as prom

    reg = prom.CollectorRegistry()
    h = prom.Histogram("t", "t", buckets=(0.1, 0.2, 0.4), registry=reg)
    xs = [0.05, 0.15, 0.15, 0.3, 0.3, 0.3, 0.35, 0.9]
    for x in xs:
        h.observe(x)
    buckets = [
        (float(s.labels["le"]), s.value) for s in reg.collect().__next__().samples if s.name == "t_bucket"
    ]
    assert buckets == [(0.1, 1.0), (0.2, 3.0), (0.4, 7.0), (math.inf, 8.0)]
    assert exercises.histogram_quantile(0.5, buckets) == pytest.approx(0.2 + 0.2 * (4 - 3) / 4)
    reqs = [
        {"send": 0.0, "first_token": 0.1, "finish": 0.5, "num_output_tokens": 5},
        {"send": 0.2, "first_token": 0.9, "finish": 1.0, "num_output_tokens": 1},
    ]
    t = RequestTiming(0.0, 0.1, 0.5, 5)
    assert t.tpot == pytest.approx(0.1)
    assert exercises.goodput(reqs, 0.5, 0.1 + 1e-9) == pytest.approx(1 / 1.0)
