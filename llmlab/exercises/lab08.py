"""Lab 08 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations



def rank_coords(rank: int, dp: int, tp: int, pp: int) -> dict:
    """Lab 08. Megatron's rank order (tp fastest, then dp, then pp): return ``{"dp", "tp", "pp"}``
    indices of ``rank``."""
    return {"pp": rank // (dp * tp), "dp": (rank // tp) % dp, "tp": rank % tp}


EXERCISES = [rank_coords]
