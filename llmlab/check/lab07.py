"""Checks for the lab 07 exercises (:mod:`llmlab.solutions.lab07`)."""

from __future__ import annotations

import math
import random

from llmlab.check._base import _fail, _ok
from llmlab.solutions import lab07 as ex


def schedule_step(fn) -> bool:
    name = "schedule_step"
    cases = [
        ([("a", 1), ("b", 1)], [("c", 30), ("d", 5)], 4, 16),
        ([], [("c", 30)], 4, 16),
        ([("a", 1)], [("c", 3), ("d", 5)], 2, 100),
    ]
    for running, waiting, s, t in cases:
        want, got = ex.schedule_step(running, waiting, s, t), fn(running, waiting, s, t)
        if list(map(tuple, got)) != want:
            _fail(
                name,
                f"running={running}, waiting={waiting}, max_num_seqs={s}, max_num_batched_tokens={t}",
                want,
                got,
                "running requests first, then waiting ones in order; a prompt that does not fit "
                "the remaining budget gets a chunk of it (chunked prefill).",
            )
    return _ok(name, "token budgets, max_num_seqs and chunked prefill match")


def _timestamps(seed: int, n: int) -> list[dict]:
    """A served workload's timestamps: requests arrive over 2 s, queue, prefill, then decode;
    request 0 generates a single token."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arrival = rng.uniform(0.0, 2.0)
        sched = arrival + rng.expovariate(2.0)  # waited in the queue
        first = sched + rng.uniform(0.01, 0.05)  # prefill
        k = 1 if i == 0 else rng.randint(2, 40)
        out.append(
            {
                "arrival": arrival,
                "first_scheduled": sched,
                "first_token": first,
                "finish": first + (k - 1) * rng.uniform(0.01, 0.03),
                "num_output_tokens": k,
            }
        )
    return out


_HINTS = {
    "ttft_s": "TTFT is first token minus *arrival*: the time a request waited in the queue counts.",
    "tpot_s": "TPOT is (finish - first token) / (output tokens - 1), the gaps between tokens; a "
    "one-token request has no TPOT and is left out.",
    "throughput_tokens_per_s": "throughput is all output tokens over the span from the first "
    "arrival to the last finish (not a sum or mean of per-request "
    "times).",
}


def serving_metrics(fn) -> bool:
    name = "serving_metrics"
    for seed, n in ((0, 3), (1, 25)):
        reqs = _timestamps(seed, n)
        want, got = ex.serving_metrics(reqs), fn([dict(r) for r in reqs])
        what = f"{n} requests (timestamps from seed {seed}; request 0 generated one token)"
        if not isinstance(got, dict):
            _fail(
                name,
                what,
                "a dict with ttft_s, tpot_s, throughput_tokens_per_s",
                got,
                "return {'ttft_s': {'p50', 'p99'}, 'tpot_s': {'p50', 'p99'}, "
                "'throughput_tokens_per_s': float}.",
            )
        for key in ("ttft_s", "tpot_s", "throughput_tokens_per_s"):
            w, g = want[key], got.get(key)
            if key == "throughput_tokens_per_s":
                if not isinstance(g, (int, float)) or not math.isclose(g, w, rel_tol=1e-9):
                    _fail(name, f"{what}: {key}", w, g, _HINTS[key])
                continue
            for q in ("p50", "p99"):
                gq = g.get(q) if isinstance(g, dict) else None
                if not isinstance(gq, (int, float)) or not math.isclose(gq, w[q], rel_tol=1e-9):
                    hint = _HINTS[key]
                    if q == "p99":
                        hint += (
                            " Percentiles interpolate linearly: position (n - 1) * q / 100 "
                            "in the sorted values, between its two neighbours."
                        )
                    _fail(name, f"{what}: {key} {q} (seconds)", w[q], gq, hint)
    return _ok(name, "TTFT, TPOT p50/p99 and throughput match on two workloads")


def preempt_victims(fn) -> bool:
    name = "preempt_victims"
    cases = [  # (running [(id, arrival, blocks_held, blocks_needed)], free blocks)
        ([("a", 0.0, 3, 1), ("b", 1.0, 2, 1), ("c", 2.0, 1, 1)], 1),
        ([("x", 5.0, 4, 1), ("y", 1.0, 2, 1), ("z", 3.0, 1, 1)], 0),
        ([("a", 0.0, 2, 1), ("b", 1.0, 1, 1), ("c", 2.0, 1, 1)], 0),
        ([("a", 0.0, 2, 1), ("b", 1.0, 1, 0)], 5),
        ([("p", 1.0, 1, 1), ("q", 1.0, 1, 1)], 1),
    ]
    for running, free in cases:
        want, got = ex.preempt_victims(list(running), free), fn(list(running), free)
        what = f"running={running} (id, arrival, blocks held, blocks needed), {free} free blocks"
        try:
            victims, left = list(got[0]), got[1]
        except (TypeError, IndexError, KeyError):
            _fail(name, what, want, got, "return (list of victim ids, free blocks afterwards).")
        if victims != want[0]:
            if set(victims) == set(want[0]):
                hint = "right victims, wrong order: the most recently arrived goes first."
            elif len(victims) > len(want[0]) and victims[: len(want[0])] == want[0]:
                hint = (
                    "too many victims: stop as soon as the requests still running need no more "
                    "blocks than are free; a preempted request needs nothing this step."
                )
            elif not want[0]:
                hint = "nothing needs to be preempted when the free blocks cover every request's need."
            else:
                hint = (
                    "vLLM preempts the most recently arrived running request (ties: the later "
                    "in the list), so the oldest requests keep making progress."
                )
            _fail(name, f"{what}: victims", want[0], victims, hint)
        if left != want[1]:
            _fail(
                name,
                f"{what}: free blocks afterwards",
                want[1],
                left,
                "preemption by recompute returns every block the victim held to the pool.",
            )
    return _ok(name, "victims (latest arrival first) and freed blocks match on 5 cases")
