"""Pipeline parallelism: the bubble, and how many micro-batches a stage holds activations for.

With ``p`` stages, ``m`` micro-batches per step and ``v`` model chunks per rank (interleaved
schedule), each rank idles for ``(p−1)/v`` micro-batch times per flush while the pipeline fills
and drains (GPipe, Huang et al. 2019, §2.2; Megatron-LM, Narayanan et al. 2021, §2.2.1-2.2.2):

* bubble time / ideal time = ``(p−1)/(v·m)``; bubble / total = ``(p−1)/(v·m + p − 1)``.

Activations: GPipe runs every forward first, so a stage holds ``m`` micro-batches; 1F1B starts
backward after ``p`` forwards, so the first stage holds ``min(m, p)``; interleaved 1F1B holds
``(1 + (p−1)/(p·v))`` times 1F1B's (Korthikanti et al. 2022, §4.2.3). The planner
(:mod:`llmlab.planner`) uses both; the pipeline runner (:mod:`llmlab.parallel.pipeline_schedules`)
measures them.
"""
from __future__ import annotations

from llmlab.formulas._checks import check_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def pipeline_bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of one flush, ``(p−1)/(v·m + p − 1)`` (0 for one stage). ``ValueError`` for a
    count < 1. Source: Megatron-LM SC'21 (Narayanan et al. 2021), §2.2.1-2.2.2."""
    for name, x in (("pp", p), ("num_microbatches", m), ("virtual_stages", v)):
        check_ranks(x, name)
    return (p - 1) / (v * m + p - 1)


def pipeline_bubble_time(ideal_s: float, p: int, m: int, v: int = 1) -> float:
    """Seconds of bubble added to ``ideal_s``, the time of ``m`` micro-batches' work on one
    stage without idling: ``ideal_s · (p−1)/(v·m)``."""
    for name, x in (("pp", p), ("num_microbatches", m), ("virtual_stages", v)):
        check_ranks(x, name)
    return ideal_s * (p - 1) / (v * m)


def microbatches_in_flight(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations the first stage holds at its peak, in units of one
    micro-batch through all of that rank's layers: GPipe ``m``; 1F1B ``min(m, p)``; interleaved
    ``min(m, p)·(1 + (p−1)/(p·v))``; one stage: 1 (micro-batches run one after another).

    Raises ``ValueError`` for an unknown schedule or a count < 1.
    Source: Korthikanti et al. 2022 (arXiv 2205.05198), §4.2.3.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    for name, x in (("pp", p), ("num_microbatches", m), ("virtual_stages", v)):
        check_ranks(x, name)
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    inflight = float(min(m, p))
    return inflight * (1 + (p - 1) / (p * v)) if schedule == "interleaved" else inflight
