"""Lab 08 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations


def rank_coords(rank: int, dp: int, tp: int, pp: int) -> dict:
    """Lab 08. Megatron's rank order (tp fastest, then dp, then pp): return ``{"dp", "tp", "pp"}``
    indices of ``rank``."""
    return {"pp": rank // (dp * tp), "dp": (rank // tp) % dp, "tp": rank % tp}


def parallel_groups(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Lab 08. Every process group of a ``dp x tp x pp`` mesh, in Megatron's rank order (tp
    fastest, then dp, then pp; Narayanan et al. 2021, §3; Megatron-LM ``parallel_state``).

    Return ``{"tp": groups, "dp": groups, "pp": groups}``: for each kind, the list of its groups,
    each the list of global ranks that share every *other* coordinate, ordered by their coordinate
    along that kind (so ``group[i]`` has index ``i``). There are ``dp*pp`` TP groups of ``tp``
    ranks, ``tp*pp`` DP groups of ``dp`` ranks and ``dp*tp`` PP groups of ``pp`` ranks. E.g. for
    dp2 x tp2 x pp1: tp ``[[0, 1], [2, 3]]``, dp ``[[0, 2], [1, 3]]``, pp ``[[0], [1], [2], [3]]``.
    """

    def rank(d, t, p):
        return (p * dp + d) * tp + t

    return {
        "tp": [[rank(d, t, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(d, t, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(d, t, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


def pick_layout(
    num_params: float, num_gpus: int, gpu_bytes: float, gpus_per_node: int = 8
) -> tuple[int, int, int]:
    """Lab 08. Choose ``(dp, tp, pp)`` for a model of ``num_params`` parameters on ``num_gpus``
    GPUs of ``gpu_bytes`` bytes each (Narayanan et al. 2021, §3.3, takeaways #1-#2).

    Mixed-precision Adam keeps 2 + 2 + 12 = 16 bytes of model states per parameter (ZeRO, §3.1);
    tensor and pipeline parallelism divide them by ``tp * pp``, data parallelism does not. A
    layout is allowed if ``dp * tp * pp == num_gpus`` and ``tp`` divides ``gpus_per_node`` (TP stays
    inside a node); it fits if ``16 * num_params / (tp * pp) <= gpu_bytes``. Among the layouts that
    fit, return the one with the largest ``dp`` (least model parallelism), and for equal ``dp`` the
    one with the smaller ``pp`` (use the node's fast links for TP first). Raises ``ValueError`` if
    no layout fits.
    """
    best = None
    for tp in range(1, min(gpus_per_node, num_gpus) + 1):
        if gpus_per_node % tp or num_gpus % tp:
            continue
        for pp in range(1, num_gpus // tp + 1):
            if (num_gpus // tp) % pp or 16 * num_params / (tp * pp) > gpu_bytes:
                continue
            dp = num_gpus // (tp * pp)
            if best is None or (dp, -pp) > (best[0], -best[2]):
                best = (dp, tp, pp)
    if best is None:
        raise ValueError(
            f"a model of {num_params:.3g} parameters (16 bytes each) does not fit on "
            f"{num_gpus} GPUs of {gpu_bytes:.3g} bytes with any dp x tp x pp layout"
        )
    return best


EXERCISES = [rank_coords, parallel_groups, pick_layout]
