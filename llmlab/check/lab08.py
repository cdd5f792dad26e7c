"""Checks for the lab 08 exercises (:mod:`llmlab.solutions.lab08`)."""

from __future__ import annotations


from llmlab.check._base import _fail, _ok
from llmlab.solutions import lab08 as ex


def rank_coords(fn) -> bool:
    name = "rank_coords"
    for dp, tp, pp in ((2, 2, 2), (2, 4, 1), (1, 2, 4)):
        for r in range(dp * tp * pp):
            want, got = ex.rank_coords(r, dp, tp, pp), fn(r, dp, tp, pp)
            if got != want:
                _fail(
                    name,
                    f"rank {r} in dp{dp} x tp{tp} x pp{pp}",
                    want,
                    got,
                    "tensor parallel is the fastest-varying index (same node), then data, then pipeline.",
                )
    return _ok(name, "Megatron coordinates for 3 meshes match")


def parallel_groups(fn) -> bool:
    name = "parallel_groups"
    for dp, tp, pp in ((2, 2, 1), (2, 2, 2), (1, 2, 4), (3, 2, 1)):
        want, got = ex.parallel_groups(dp, tp, pp), fn(dp, tp, pp)
        for kind in ("tp", "dp", "pp"):
            w = sorted(want[kind])
            g = sorted(list(map(list, got.get(kind, [])))) if isinstance(got, dict) else None
            if g == w:
                continue
            if g is not None and sorted(map(sorted, g)) == w:
                hint = (
                    f"the same ranks, in another order inside a group: order each {kind} group "
                    f"by its {kind} index (ascending ranks in Megatron's order)."
                )
            else:
                swapped = next((k for k in ("tp", "dp", "pp") if k != kind and g == sorted(want[k])), None)
                hint = (f"these are the {swapped} groups: " if swapped else "") + (
                    "rank = (pp_index * dp + dp_index) * tp + tp_index (tp fastest, then dp, then pp); "
                    f"a {kind} group varies only the {kind} index."
                )
            _fail(name, f"the {kind} groups of dp{dp} x tp{tp} x pp{pp}", w, g, hint)
    return _ok(name, "TP, DP and PP groups of 4 meshes match Megatron's order")


def pick_layout(fn) -> bool:
    name = "pick_layout"
    GB = 1e9
    cases = [
        (8e9, 8, 56 * GB),
        (8e9, 8, 200 * GB),
        (1e9, 8, 10 * GB),
        (70e9, 16, 80 * GB),
        (70e9, 64, 80 * GB),
        (8e9, 4, 40 * GB),
    ]
    for psi, n, mem in cases:
        what = f"{psi / 1e9:g}B parameters on {n} GPUs of {mem / GB:g} GB"
        want = ex.pick_layout(psi, n, mem)
        try:
            got = fn(psi, n, mem)
        except ValueError as e:
            tp, pp = want[1], want[2]
            _fail(
                name,
                f"the layout for {what}: a layout fits",
                want,
                f"ValueError: {e}",
                f"tp{tp} x pp{pp} leaves 16 x params / {tp * pp} = {16 * psi / (tp * pp) / GB:.1f} GB "
                "per GPU: try every tp dividing gpus_per_node and every pp, not only tp.",
            )
        got = tuple(got) if isinstance(got, (tuple, list)) else got
        if got != want:
            dp, tp, pp = want
            if isinstance(got, tuple) and len(got) == 3 and got[0] * got[1] * got[2] == n:
                per = 16 * psi / (got[1] * got[2]) / GB
                hint = (
                    f"dp{got[0]} x tp{got[1]} x pp{got[2]} needs {per:.1f} GB of model states per "
                    f"GPU (16 bytes x params / (tp x pp)): "
                    + (
                        f"that does not fit in {mem / GB:g} GB."
                        if per * GB > mem
                        else "it fits, but among the layouts that fit take the largest dp, then the "
                        "smallest pp."
                    )
                )
            else:
                hint = "dp x tp x pp must equal num_gpus, and tp must divide gpus_per_node (8)."
            _fail(
                name,
                f"the layout for {what} (expected {16 * psi / (tp * pp) / GB:.1f} GB per GPU)",
                want,
                got,
                hint,
            )
    try:
        got = fn(70e9, 8, 80 * GB)
    except ValueError:
        return _ok(name, "layouts for 6 models/clusters match, and a model too big is refused")
    _fail(
        name,
        "70B parameters (1120 GB of model states) on 8 GPUs of 80 GB",
        "ValueError",
        got,
        "when no layout fits (16 x params / 8 > 80 GB even at tp x pp = 8), raise ValueError.",
    )
