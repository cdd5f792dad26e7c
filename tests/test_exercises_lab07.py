"""Lab 07's exercise checks fail, in plain words, on realistic wrong answers; the reference
solutions agree with what llmlab itself computes (metrics module, the engine's scheduler)."""

import math

import pytest

from llmlab import check, exercises
from llmlab.check import ExerciseFailed
from llmlab.check.lab07 import _timestamps
from llmlab.inference import LLMEngine, SamplingParams
from llmlab.inference.metrics import RequestTiming, summarize
from llmlab.inference.sequence import SequenceStatus


# --- serving_metrics: realistic mistakes -------------------------------------------------------
def _ttft_from_scheduled(reqs):  # forgets the time spent in the queue
    return exercises.serving_metrics([dict(r, arrival=r["first_scheduled"]) for r in reqs])


def _tpot_over_n(reqs):  # divides by all output tokens, not the gaps between them
    out = exercises.serving_metrics(reqs)
    tp = sorted(
        (r["finish"] - r["first_token"]) / r["num_output_tokens"] for r in reqs if r["num_output_tokens"] > 1
    )
    out["tpot_s"] = {"p50": tp[(len(tp) - 1) // 2], "p99": tp[-1]}
    return out


def _tpot_keeps_one_token_requests(reqs):  # a one-token request counted with TPOT 0
    out = exercises.serving_metrics(reqs)
    tp = [(r["finish"] - r["first_token"]) / max(1, r["num_output_tokens"] - 1) for r in reqs]
    ref = exercises.serving_metrics(
        [dict(r, num_output_tokens=2, finish=r["first_token"] + t) for r, t in zip(reqs, tp)]
    )
    out["tpot_s"] = ref["tpot_s"]
    return out


def _nearest_rank_p99(reqs):  # p99 = a sorted value, no interpolation
    out = exercises.serving_metrics(reqs)
    tt = sorted(r["first_token"] - r["arrival"] for r in reqs)
    out["ttft_s"]["p99"] = tt[min(len(tt) - 1, math.ceil(0.99 * len(tt)) - 1)]
    return out


def _throughput_from_mean_latency(reqs):  # tokens / sum of per-request durations
    out = exercises.serving_metrics(reqs)
    out["throughput_tokens_per_s"] = sum(r["num_output_tokens"] for r in reqs) / sum(
        r["finish"] - r["arrival"] for r in reqs
    )
    return out


# --- preempt_victims: realistic mistakes -------------------------------------------------------
def _oldest_first(running, free):  # FIFO victim: starves the oldest requests
    return exercises.preempt_victims([(i, -t, h, n) for i, t, h, n in running], free)


def _victim_still_needs(running, free):  # a preempted request's need is still counted
    alive = sorted(running, key=lambda r: r[1])
    need, victims = sum(r[3] for r in running), []
    while alive and need > free:
        rid, _, held, _ = alive.pop()
        victims.append(rid)
        free += held
    return victims, free


def _blocks_not_freed(running, free):  # right victims, but their blocks are not returned
    victims, _ = exercises.preempt_victims(running, free)
    return victims, free


def _list_order(running, free):  # takes the last of the list, not the latest arrival
    return exercises.preempt_victims([(i, k, h, n) for k, (i, _, h, n) in enumerate(running)], free)


WRONG = [
    ("serving_metrics", _ttft_from_scheduled, "ttft_s p50", "arrival"),
    ("serving_metrics", _tpot_over_n, "tpot_s p50", "output tokens - 1"),
    ("serving_metrics", _tpot_keeps_one_token_requests, "tpot_s", "one-token request"),
    ("serving_metrics", _nearest_rank_p99, "ttft_s p99", "interpolate linearly"),
    ("serving_metrics", _throughput_from_mean_latency, "throughput_tokens_per_s", "first arrival"),
    ("preempt_victims", _oldest_first, "victims", "most recently arrived"),
    ("preempt_victims", _victim_still_needs, "victims", "too many victims"),
    ("preempt_victims", _blocks_not_freed, "free blocks afterwards", "returns every block"),
    ("preempt_victims", _list_order, "victims", "most recently arrived"),
]


@pytest.mark.parametrize("name,wrong,where,hint", WRONG, ids=[w.__name__ for _, w, _, _ in WRONG])
def test_wrong_answer_fails_with_plain_words(name, wrong, where, hint):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(wrong)
    msg = str(info.value)
    assert msg.startswith(f"{name}: ") and where in msg and hint in msg
    assert "expected:" in msg and "got:" in msg


def test_learner_stub_and_bad_return_are_explained():
    with pytest.raises(ExerciseFailed, match="return"):
        check.preempt_victims(lambda running, free: None)
    with pytest.raises(ExerciseFailed, match="a dict"):
        check.serving_metrics(lambda reqs: [1.0, 2.0])


def test_reference_metrics_equal_llmlab_metrics():
    for seed, n in ((0, 3), (1, 25), (5, 40)):
        reqs = _timestamps(seed, n)
        ref = summarize(
            [RequestTiming(r["arrival"], r["first_token"], r["finish"], r["num_output_tokens"]) for r in reqs]
        )
        got = exercises.serving_metrics(reqs)
        for k in ("ttft_s", "tpot_s"):
            for q in ("p50", "p99"):
                assert got[k][q] == pytest.approx(ref[k][q], rel=1e-12)
        assert got["throughput_tokens_per_s"] == pytest.approx(ref["throughput_tokens_per_s"], rel=1e-12)


def test_reference_victims_equal_the_engine_scheduler():
    """Before every step, predict the victims with the exercise; the engine preempts the same."""
    eng = LLMEngine("shakespeare", max_num_seqs=4, block_size=4, num_gpu_blocks=6, device="cpu")
    for i in range(4):
        eng.add_request(
            [70 + i] * 3,
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            request_id=f"r{i}",
            arrival_time=float(i),
        )
    sched, bm, seen = eng.scheduler, eng.block_manager, 0
    while eng.has_unfinished_requests():
        before = list(sched.running)
        state = [
            (
                s.request_id,
                s.arrival_time,
                len(s.block_table),
                bm.num_blocks_needed(s, s.num_uncomputed_tokens),
            )
            for s in before
        ]
        want, _ = exercises.preempt_victims(state, bm.num_free_blocks)
        eng.step()
        got = [s.request_id for s in before if s.status == SequenceStatus.WAITING]
        assert sorted(got) == sorted(want), (state, want, got)
        seen += len(got)
    assert seen >= 2  # the pool of 6 blocks cannot hold 4 growing requests
