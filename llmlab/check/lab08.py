"""Checks for the lab 08 exercises (:mod:`llmlab.exercises.lab08`)."""
from __future__ import annotations


from llmlab.check._base import _fail, _ok
from llmlab.exercises import lab08 as ex


def rank_coords(fn) -> bool:
    name = "rank_coords"
    for dp, tp, pp in ((2, 2, 2), (2, 4, 1), (1, 2, 4)):
        for r in range(dp * tp * pp):
            want, got = ex.rank_coords(r, dp, tp, pp), fn(r, dp, tp, pp)
            if got != want:
                _fail(name, f"rank {r} in dp{dp} x tp{tp} x pp{pp}", want, got,
                      "tensor parallel is the fastest-varying index (same node), then data, then "
                      "pipeline.")
    return _ok(name, "Megatron coordinates for 3 meshes match")
