"""Checks for the lab 03 exercises (:mod:`llmlab.exercises.lab03`)."""
from __future__ import annotations


from llmlab.check._base import _fail, _ok
from llmlab.exercises import lab03 as ex


def one_f_one_b(fn) -> bool:
    name = "one_f_one_b"
    for p, m in ((4, 8), (4, 2), (2, 1), (3, 5)):
        for s in range(p):
            want, got = ex.one_f_one_b(s, p, m), list(map(tuple, fn(s, p, m)))
            if got != want:
                i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                _fail(name, f"stage {s} of {p}, {m} micro-batches: first difference at action {i}",
                      want, got, "warm-up forwards = min(p - stage - 1, m); then one F and one B "
                                 "alternating; micro-batches go in increasing order in each direction.")
    return _ok(name, "1F1B action lists for 4 pipeline shapes match, every stage")
