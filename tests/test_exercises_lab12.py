"""Lab 12's exercise checks fail, in plain words, on realistic wrong answers; the references agree
with the planner's serving formulas and with the engine's KV pool arithmetic."""

import pytest

from llmlab import check, exercises
from llmlab.check import ExerciseFailed
from llmlab.formulas import serving as F


def _kv_without_factor_2(L, kv, hd, b, tp=1):
    return L * (kv // tp) * hd * b


def _kv_ignores_tp(L, kv, hd, b, tp=1):
    return 2 * L * kv * hd * b


def _concurrency_without_blocks(budget, bpt, bs, n):
    return int(max(budget, 0) // (bpt * n)) if budget > 0 else 0


def _tpot_weights_per_sequence(w, kv, b, c, bw):
    return (b * w + b * c * kv) / bw


WRONG = [
    ("kv_bytes_per_token", _kv_without_factor_2, "the factor 2"),
    ("kv_bytes_per_token", _kv_ignores_tp, "kv_heads / tp"),
    ("kv_concurrency", _concurrency_without_blocks, "whole blocks"),
    ("decode_tpot", _tpot_weights_per_sequence, "read once per step"),
]


@pytest.mark.parametrize("name,wrong,words", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_wrong_answer_is_explained(name, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(wrong)
    assert words in str(info.value) and "expected:" in str(info.value)


def test_references_agree_with_the_planner():
    assert exercises.kv_bytes_per_token(80, 8, 128, 2, 8) == F.kv_bytes_per_token(80, 8, 128, 2, 8) == 40960
    blocks = F.kv_pool_blocks(53.7e9, 40960, 16)
    assert exercises.kv_concurrency(53.7e9, 40960, 16, 10240) == F.max_concurrency(blocks, 16, 10240) == 128
    assert exercises.decode_tpot(16e9, 131072, 1, 512, 3.35e12) == pytest.approx(
        F.decode_step_time(16e9, 512 * 131072, 0.0, 3.35e12, 1e15)
    )
