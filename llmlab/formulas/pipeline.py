"""Pipeline parallelism: the bubble, and how many micro-batches a stage holds activations for.

With ``p`` stages, ``m`` micro-batches per step and ``v`` model chunks per rank (interleaved
schedule), each rank idles for ``(p−1)/v`` micro-batch times per flush while the pipeline fills
and drains (GPipe, Huang et al. 2019, §2.2; Megatron-LM, Narayanan et al. 2021, §2.2.1-2.2.2):

* bubble time / ideal time = ``(p−1)/(v·m)``; bubble / total = ``(p−1)/(v·m + p − 1)``.

Activations: GPipe runs every forward first, so a stage holds ``m`` micro-batches; 1F1B starts
backward after ``p`` forwards, so the first stage holds ``min(m, p)``; interleaved 1F1B holds
``(1 + (p−1)/(p·v))`` times 1F1B's (Korthikanti et al. 2022, §4.2.3) when ``m`` exceeds its
warm-up, and the ``m`` micro-batches of the step when it does not (``m = p``). The planner
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


def microbatches_in_flight(schedule: str, p: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` (0: the first stage) holds at its
    peak, in units of one micro-batch through all of that rank's layers: GPipe ``m``; 1F1B
    ``min(m, p − rank)``; interleaved ``min(m·v, 2(p−rank−1) + (v−1)p + 1) / v`` model chunks of
    ``1/v`` of the rank's layers each (its warm-up forwards plus the steady state's one; for the
    first stage and ``m`` large that is ``p·(1 + (p−1)/(p·v))``, Korthikanti et al.'s figure, and
    it is capped by the ``m·v`` chunks a step has: with ``m = p`` the first stage holds ``m``,
    not ``m·(1 + (p−1)/(p·v))``); one stage: 1 (micro-batches run one after another).

    Raises ``ValueError`` for an unknown schedule, a count < 1 or a rank outside ``[0, p)``.
    Source: Korthikanti et al. 2022 (arXiv 2205.05198), §4.2.3; the warm-up counts of
    Megatron-LM's schedules (Narayanan et al. 2021, §2.2), as
    :func:`llmlab.parallel.pipeline_schedules.compute_order` runs them.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    for name, x in (("pp", p), ("num_microbatches", m), ("virtual_stages", v)):
        check_ranks(x, name)
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank} must be in [0, pp={p})")
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v
    return float(min(m, p - rank))
