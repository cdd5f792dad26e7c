"""Every exercise check passes on the reference solution and fails, in plain words, on a wrong one."""

import tempfile

import pytest
import torch
import torch.distributed as dist

from llmlab import check, exercises
from llmlab.check import ExerciseFailed


@pytest.mark.parametrize("name", sorted(exercises.SOLUTIONS))
def test_reference_solution_passes(name, capsys):
    assert getattr(check, name)(exercises.SOLUTIONS[name]) is True
    assert capsys.readouterr().out.startswith(f"✓ {name}")


def _ring_off_by_one(chunks, rank, world):
    exercises.ring_reduce_scatter(chunks, rank, world)
    return chunks[rank]  # forgot which chunk ends complete (and returns an unreduced one)


def _row_without_all_reduce(x, w, b, group=None):
    return x @ w.t() + b


def _row_bias_before_all_reduce(x, w, b, group=None):
    y = x @ w.t() + b
    dist.all_reduce(y, group=group)
    return y


def _one_f_one_b_backwards_reversed(stage, p, m):
    acts = exercises.one_f_one_b(stage, p, m)
    bs = [a for a in acts if a[0] == "B"][::-1]
    it = iter(bs)
    return [a if a[0] == "F" else next(it) for a in acts]


def _topk_not_renormalised(logits, k, cap):
    e, w, kept = exercises.topk_route(logits, k, cap)
    return e, logits.float().softmax(-1).gather(1, e), kept


def _shard_floor(numel, world, rank):
    per = numel // world  # off by one: drops the remainder
    return rank * per, (rank + 1) * per


def _append_without_cow(table, n, bs, refs, free):
    if n % bs == 0:
        b = free.pop(0)
        refs[b] = 1
        return table + [b], None
    return table, None


def _schedule_waiting_first(running, waiting, s, t):
    return exercises.schedule_step(waiting, running, s, t)


def _coords_pp_fastest(rank, dp, tp, pp):
    return {"pp": rank % pp, "dp": (rank // pp) % dp, "tp": rank // (pp * dp)}


def _online_softmax_no_rescale(m, l, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(-1))
    p = torch.exp(scores - m_new[:, None])
    return m_new, l + p.sum(-1), acc + p @ v


def _memory_one_state(n):
    return {"params": 4 * n, "grads": 4 * n, "optimizer_states": 4 * n}


WRONG = [
    ("ring_reduce_scatter", _ring_off_by_one, "rank 0 should end with the fully reduced chunk 1"),
    ("row_parallel_forward", _row_without_all_reduce, "all-reduce it before adding the bias once"),
    ("row_parallel_forward", _row_bias_before_all_reduce, "rank 0 output differs"),
    ("one_f_one_b", _one_f_one_b_backwards_reversed, "first difference at action"),
    ("topk_route", _topk_not_renormalised, "weights for k=1"),
    ("shard_range", _shard_floor, "for a buffer of 10 elements"),
    ("append_slot", _append_without_cow, "copy-on-write"),
    ("schedule_step", _schedule_waiting_first, "running requests first"),
    ("rank_coords", _coords_pp_fastest, "rank 1 in dp2 x tp2 x pp2"),
    ("online_softmax_update", _online_softmax_no_rescale, "rescale the old l and acc"),
    ("training_memory_bytes", _memory_one_state, "optimizer_states for 1 parameters"),
]


@pytest.mark.parametrize("name,wrong,words", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_wrong_answer_is_explained(name, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(wrong)
    msg = str(info.value)
    assert words in msg and "expected:" in msg and "hint:" in msg
    assert not isinstance(info.value, AssertionError)


def test_a_rank_that_raises_is_reported_as_an_exercise_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where launch puts its log folder

    def broken(chunks, rank, world):
        raise NotImplementedError("write the ring here")

    with pytest.raises(ExerciseFailed, match="still the stub") as info:
        check.ring_reduce_scatter(broken)
    assert "exercises.reveal('ring_reduce_scatter')" in str(info.value)

    def crashes(chunks, rank, world):
        raise ValueError("shapes")

    with pytest.raises(ExerciseFailed, match="every rank must take part") as info:
        check.ring_reduce_scatter(crashes)
    assert "still the stub" not in str(info.value)
    assert not list(tmp_path.glob("llmlab-logs-*"))  # the failed launches' logs are not left behind


def test_switching_one_exercise_to_its_solution(monkeypatch):
    monkeypatch.delenv("LLMLAB_SOLUTIONS", raising=False)
    mine = lambda *a: None  # noqa: E731
    assert exercises.pick("shard_range", mine) is mine
    monkeypatch.setenv("LLMLAB_SOLUTIONS", "1")
    assert exercises.pick("shard_range", mine) is exercises.shard_range
    monkeypatch.delenv("LLMLAB_SOLUTIONS")
    exercises.reveal("rank_coords")
    assert exercises.pick("rank_coords", mine) is exercises.rank_coords
    with pytest.raises(KeyError, match="no exercise named 'nope'"):
        exercises.reveal("nope")


def _stub(*args):
    raise NotImplementedError("exercise: write me")


@pytest.mark.parametrize("name", ["ring_reduce_scatter", "shard_range", "schedule_step"])
def test_one_stub_message_on_ranks_or_not(name):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(_stub)
    from llmlab.check._base import stub_failure

    assert str(info.value) == str(stub_failure(name))


def test_without_solutions_a_failed_check_prints_and_use_hands_on_the_reference(monkeypatch, capsys):
    monkeypatch.delenv("LLMLAB_SOLUTIONS", raising=False)
    monkeypatch.delenv("LLMLAB_STRICT", raising=False)
    assert check.shard_range(_shard_floor) is False
    out = capsys.readouterr().out
    assert (
        out.startswith("✗ shard_range: rank") and "hint:" in out and "exercises.reveal('shard_range')" in out
    )
    assert exercises.use("schedule_step", _stub) is exercises.schedule_step
    out = capsys.readouterr().out
    assert out.startswith("✗ schedule_step: the function is still the stub") and "reference solution" in out
    crash = lambda *a: 1 / 0  # noqa: E731
    assert exercises.use("pick_layout", crash) is exercises.pick_layout
    assert "ZeroDivisionError" in capsys.readouterr().out
    mine = exercises.SOLUTIONS["ddp_buckets"]
    assert exercises.use("ddp_buckets", lambda *a: mine(*a)) is not mine  # a passing function is kept
    monkeypatch.setenv("LLMLAB_STRICT", "1")
    with pytest.raises(ExerciseFailed, match="still the stub"):
        exercises.use("schedule_step", _stub)
