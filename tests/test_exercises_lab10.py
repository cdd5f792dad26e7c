"""Lab 10 checks fail, in plain words, on typical wrong answers (the reference solutions pass in
tests/test_exercises.py, which runs every exercise)."""

import pytest
import torch

from llmlab import check, exercises
from llmlab.check import ExerciseFailed


def _merge_without_max(out_a, lse_a, out_b, lse_b):
    w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)  # overflows for large scores
    return (out_a * w_a[:, None] + out_b * w_b[:, None]) / (w_a + w_b)[:, None], torch.log(w_a + w_b)


def _merge_plain_average(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return (out_a + out_b) / 2, m + torch.log(torch.exp(lse_a - m) + torch.exp(lse_b - m))


def _contiguous_chunk(seq_len, cp, rank):
    n = seq_len // cp
    return list(range(rank * n, (rank + 1) * n))


def _seq_to_head_no_permute(x, group=None):
    from llmlab.runtime import comm

    N = comm.group_size(group)
    B, H, T, D = x.shape
    send = x.reshape(N, B * H * T * D // N).contiguous()  # splits the batch, not the heads
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    return recv.reshape(B, H // N, N * T, D)


@pytest.mark.parametrize(
    "name, wrong, words",
    [
        ("merge_partials", _merge_without_max, "contains nan"),
        ("merge_partials", _merge_plain_average, "merged output, row 0"),
        ("load_balanced_indices", _contiguous_chunk, "rank 0 holds chunk 0"),
        ("seq_to_head", _seq_to_head_no_permute, "dim 0 of the all-to-all input must be the destination"),
    ],
)
def test_wrong_answer_is_explained(name, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(wrong)
    msg = str(info.value)
    assert words in msg and "hint:" in msg


def test_solutions_are_the_library_functions():
    from llmlab.kernels.online_softmax import merge_softmax_partials
    from llmlab.parallel.context_parallel import token_indices

    g = torch.Generator().manual_seed(1)
    a, b, la, lb = (
        torch.randn(3, 2, generator=g),
        torch.randn(3, 2, generator=g),
        torch.randn(3, generator=g),
        torch.randn(3, generator=g),
    )
    for x, y in zip(exercises.merge_partials(a, la, b, lb), merge_softmax_partials(a, la, b, lb)):
        torch.testing.assert_close(x, y)
    assert exercises.load_balanced_indices(16, 4, 1) == token_indices(16, 4, 1, "ring").tolist()
