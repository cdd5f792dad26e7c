"""Checks for the lab 09 exercises (:mod:`llmlab.exercises.lab09`)."""
from __future__ import annotations

import torch

from llmlab.check._base import _fail, _ok, _close


def online_softmax_update(fn) -> bool:
    name = "online_softmax_update"
    g = torch.Generator().manual_seed(0)
    q_len, d = 3, 4
    scores, v = torch.randn(q_len, 12, generator=g) * 3, torch.randn(12, d, generator=g)
    m, l, acc = torch.full((q_len,), float("-inf")), torch.zeros(q_len), torch.zeros(q_len, d)
    for j in range(0, 12, 4):
        m, l, acc = fn(m, l, acc, scores[:, j:j + 4], v[j:j + 4])
    want = scores.softmax(-1) @ v
    got = acc / l[:, None]
    if not _close(got, want):
        _fail(name, "after 3 tiles, acc / l should equal softmax(scores) @ V", want, got,
              "when the running max grows, rescale the old l and acc by exp(m_old - m_new).")
    return _ok(name, "three tiles of online softmax equal the full softmax @ V")
