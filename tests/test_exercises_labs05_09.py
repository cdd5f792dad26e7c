"""The checks of the lab 05, 06, 08 and 09 exercises fail, in plain words, on realistic wrong answers.

(The generic tests in tests/test_exercises.py run every registered reference solution and expect
it to pass.) Communication exercises run on real gloo ranks, 3 of them, with tensors of 10 elements.
"""
import pytest
import torch
import torch.nn.functional as F

from llmlab import check, exercises
from llmlab.check import ExerciseFailed
from llmlab.runtime import comm


# --- lab 05: ZeRO ----------------------------------------------------------------------------------
def _zero2_sum_not_mean(flat_grad, rank, world):
    per = -(-flat_grad.numel() // world)
    out = torch.empty(per)
    comm.reduce_scatter_tensor(out, F.pad(flat_grad, (0, per * world - flat_grad.numel())))
    start, end = exercises.shard_range(flat_grad.numel(), world, rank)
    return out[:end - start]                                   # forgot to divide by world


def _zero2_no_reduce(flat_grad, rank, world):
    start, end = exercises.shard_range(flat_grad.numel(), world, rank)
    return flat_grad[start:end]                                # kept the local gradient only


def _zero2_floor_shards(flat_grad, rank, world):
    per = flat_grad.numel() // world                           # off by one: no padding
    out = torch.empty(per)
    comm.reduce_scatter_tensor(out, flat_grad[:per * world].contiguous())
    return out / world


def _zero1_no_all_gather(flat_param, grad_shard, rank, world, lr):
    start, end = exercises.shard_range(flat_param.numel(), world, rank)
    p = flat_param.clone()
    p[start:end] -= lr * grad_shard                            # the other shards stay stale
    return p


def _zero1_sign_flipped(flat_param, grad_shard, rank, world, lr):
    return exercises.zero1_update(flat_param, -grad_shard, rank, world, lr)


WRONG = [
    ("zero2_grad_shard", _zero2_sum_not_mean, ["rank 0's shard [0:4)", "divide by world"]),
    ("zero2_grad_shard", _zero2_no_reduce, ["rank 0's shard", "reduced over all ranks"]),
    ("zero2_grad_shard", _zero2_floor_shards, ["rank 0 should return its shard [0:4)", "shape [4]"]),
    ("zero1_update", _zero1_no_all_gather, ["rank 0's updated parameters", "owned by rank 1",
                                            "all-gather the shards of the others"]),
    ("zero1_update", _zero1_sign_flipped, ["first wrong element 0 (owned by rank 0)", "p - lr * grad_shard"]),
]


@pytest.mark.parametrize("name,wrong,words", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_wrong_answer_is_explained(name, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(wrong)
    msg = str(info.value)
    for w in words + ["expected:", "got:", "hint:"]:
        assert w in msg, (w, msg)
