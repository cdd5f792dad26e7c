"""Lab 07 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations



def schedule_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]],
                  max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[str, int]]:
    """Lab 07. One continuous-batching step (Orca, Yu et al. 2022; vLLM v1 style).

    ``running``/``waiting``: ``(request_id, tokens_still_to_compute)`` in FCFS order. First every
    running request gets its tokens (decode: usually 1) while the token budget lasts, then waiting
    requests are admitted in order while fewer than ``max_num_seqs`` are scheduled, each getting
    ``min(remaining, budget left)`` tokens (chunked prefill). Return ``[(request_id, tokens)]``.
    """
    out, budget = [], max_num_batched_tokens
    for rid, n in running + waiting:
        if budget <= 0 or len(out) >= max_num_seqs:
            break
        take = min(n, budget)
        out.append((rid, take))
        budget -= take
    return out


EXERCISES = [schedule_step]
