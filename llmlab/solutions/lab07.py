"""Lab 07 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

import math


def schedule_step(
    running: list[tuple[str, int]],
    waiting: list[tuple[str, int]],
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> list[tuple[str, int]]:
    """Lab 07. One continuous-batching step (Orca, Yu et al. 2022; vLLM v1 style).

    ``running``/``waiting``: ``(request_id, tokens_still_to_compute)`` in FCFS order. First every
    running request gets its tokens (decode: usually 1) while the token budget lasts, then waiting
    requests are admitted in order while fewer than ``max_num_seqs`` are scheduled, each getting
    ``min(remaining, budget left)`` tokens (chunked prefill). Return ``[(request_id, tokens)]``.
    """
    out: list[tuple[str, int]] = []
    budget = max_num_batched_tokens
    for rid, n in running + waiting:
        if budget <= 0 or len(out) >= max_num_seqs:
            break
        take = min(n, budget)
        out.append((rid, take))
        budget -= take
    return out


def serving_metrics(requests: list[dict]) -> dict:
    """Lab 07. TTFT, TPOT and throughput from per-request timestamps (the definitions of vLLM's
    ``benchmarks/benchmark_serving.py``, which llmlab's ``bench serve`` follows).

    ``requests``: one dict per request with ``arrival``, ``first_scheduled``, ``first_token``,
    ``finish`` (seconds, same clock) and ``num_output_tokens``. Return
    ``{"ttft_s": {"p50", "p99"}, "tpot_s": {"p50", "p99"}, "throughput_tokens_per_s"}`` where

    - TTFT = first token - **arrival** (queueing time counts: the user was waiting);
    - TPOT = (finish - first token) / (output tokens - 1): the gaps *between* tokens, so a
      one-token request has no TPOT and is left out of the TPOT percentiles;
    - percentiles interpolate linearly between sorted values (position ``(n - 1) * q / 100``,
      numpy's default);
    - throughput = all output tokens / (last finish - first arrival), tokens/s.
    """

    def pct(xs, q):
        xs = sorted(xs)
        pos = (len(xs) - 1) * q / 100.0
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    ttft = [r["first_token"] - r["arrival"] for r in requests]
    tpot = [
        (r["finish"] - r["first_token"]) / (r["num_output_tokens"] - 1)
        for r in requests
        if r["num_output_tokens"] > 1
    ]
    span = max(r["finish"] for r in requests) - min(r["arrival"] for r in requests)
    return {
        "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_s": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "throughput_tokens_per_s": sum(r["num_output_tokens"] for r in requests) / span,
    }


def preempt_victims(
    running: list[tuple[str, float, int, int]], num_free_blocks: int
) -> tuple[list[str], int]:
    """Lab 07. Who is preempted when the KV cache runs out (vLLM, Kwon et al. SOSP 2023 §4.5).

    ``running``: ``(request_id, arrival_time, blocks_held, blocks_needed)`` of every running
    request, in any order; ``blocks_needed`` is how many new blocks it needs this step (a decode
    crossing a block boundary needs 1). While the requests still running need more blocks than
    are free, preempt the **most recently arrived** running request (ties: the later in the
    list), by recompute: all its blocks return to the pool and it needs nothing this step.
    Return ``(victim ids in preemption order, free blocks afterwards)``.
    """
    alive = sorted(enumerate(running), key=lambda x: (x[1][1], x[0]))  # earliest first
    victims, free = [], num_free_blocks
    while alive and sum(r[3] for _, r in alive) > free:
        _, (rid, _, held, _) = alive.pop()
        victims.append(rid)
        free += held
    return victims, free


EXERCISES = [schedule_step, serving_metrics, preempt_victims]
