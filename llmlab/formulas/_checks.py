"""Argument checks shared by the formula modules (``ValueError`` naming the argument)."""
from __future__ import annotations

import math


def check_count(name: str, value, allow_zero: bool = False) -> float:
    """``value`` if it is a finite number > 0 (>= 0 with ``allow_zero``), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return value


def check_ranks(n, name: str = "dp (data-parallel degree)") -> int:
    """``n`` if it is an integer >= 1, else ``ValueError``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
    return n


def check_stage(stage) -> int:
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    return stage
