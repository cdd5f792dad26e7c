"""The checks of the lab 00-04 exercises fail on realistic wrong answers, in plain words.

(Every registered reference passes its check in tests/test_exercises.py.) Each wrong answer is a
mistake a learner would make; the test asserts the words of the message, the expected/got lines and
the hint, and that it is an ExerciseFailed, not a bare assertion.
"""
import pytest
import torch
import torch.distributed as dist

from llmlab import check, exercises
from llmlab.check import ExerciseFailed


# --- lab 00 -----------------------------------------------------------------------------------
def _flops_forward_only(n, t, peak, mfu, g=1):
    f = 2 * n * t  # forgot the backward pass (4·N·T)
    return {"flops": f, "seconds": f / (g * peak * mfu)}


def _time_ignores_mfu(n, t, peak, mfu, g=1):
    f = 6 * n * t
    return {"flops": f, "seconds": f / (g * peak)}


def _ring_one_phase(nbytes, world, bw, lat=0.0):
    return lat + (world - 1) / world * nbytes / bw  # only the reduce-scatter


def _ring_factor_two(nbytes, world, bw, lat=0.0):
    return lat + 2 * nbytes / bw  # the N -> infinity limit, wrong for small N


WRONG = []
WRONG += [
    ("training_flops_and_time", _flops_forward_only, "flops for N=8e+09"),
    ("training_flops_and_time", _time_ignores_mfu, "seconds for N=8e+09 parameters"),
    ("ring_all_reduce_seconds", _ring_one_phase, "over 8 ranks"),
    ("ring_all_reduce_seconds", _ring_factor_two, "over 8 ranks"),
]


# --- the tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,wrong,words", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_wrong_answer_is_explained(name, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(wrong)
    msg = str(info.value)
    assert words in msg, msg
    assert "expected:" in msg and "got:" in msg and "hint:" in msg, msg
    assert not isinstance(info.value, AssertionError)


def test_every_new_exercise_has_a_wrong_answer_here():
    labs = {exercises.LAB_OF[n] for n, _, _ in WRONG}
    covered = {n for n, _, _ in WRONG}
    for name, lab in exercises.LAB_OF.items():
        if lab in labs and name not in ("training_memory_bytes", "ring_reduce_scatter",
                                        "row_parallel_forward", "one_f_one_b", "topk_route"):
            assert name in covered, name
