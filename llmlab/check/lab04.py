"""Checks for the lab 04 exercises (:mod:`llmlab.exercises.lab04`)."""
from __future__ import annotations

import torch

from llmlab.check._base import _fail, _ok, _close
from llmlab.exercises import lab04 as ex


def topk_route(fn) -> bool:
    name = "topk_route"
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 4, generator=g)
    for k, cap in ((1, None), (2, None), (2, 4), (1, 2)):
        want, got = ex.topk_route(logits, k, cap), fn(logits, k, cap)
        for part, w, o in zip(("experts", "weights", "kept"), want, got):
            if not (torch.equal(w, o) if w.dtype in (torch.bool, torch.int64) else _close(o, w)):
                _fail(name, f"{part} for k={k}, capacity={cap}", w, o,
                      "weights are softmax probabilities renormalised over the chosen k; an expert "
                      "keeps assignments in token order until it has `capacity`.")
    return _ok(name, "top-1/top-2 routing, renormalised weights and capacity drops match")
