"""Checks for the lab 07 exercises (:mod:`llmlab.exercises.lab07`)."""
from __future__ import annotations


from llmlab.check._base import _fail, _ok
from llmlab.exercises import lab07 as ex


def schedule_step(fn) -> bool:
    name = "schedule_step"
    cases = [([("a", 1), ("b", 1)], [("c", 30), ("d", 5)], 4, 16),
             ([], [("c", 30)], 4, 16), ([("a", 1)], [("c", 3), ("d", 5)], 2, 100)]
    for running, waiting, s, t in cases:
        want, got = ex.schedule_step(running, waiting, s, t), fn(running, waiting, s, t)
        if list(map(tuple, got)) != want:
            _fail(name, f"running={running}, waiting={waiting}, max_num_seqs={s}, "
                        f"max_num_batched_tokens={t}", want, got,
                  "running requests first, then waiting ones in order; a prompt that does not fit "
                  "the remaining budget gets a chunk of it (chunked prefill).")
    return _ok(name, "token budgets, max_num_seqs and chunked prefill match")
