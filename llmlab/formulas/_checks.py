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


# What a command-line flag may be, beyond its own range: small and large enough that the formulas
# built on it stay finite (1e18 parameters, tokens or bytes; 1e-9 of a unit), never a stand-in.
FLAG_MOST, FLAG_LEAST_POSITIVE = 1e18, 1e-9


def check_flag(
    flag: str,
    value,
    *,
    integer: bool = False,
    least: float = 0,
    zero_ok: bool = False,
    most: float = FLAG_MOST,
) -> None:
    """``ValueError`` naming ``flag`` unless ``value`` is a finite number (an ``int``, not a bool,
    if ``integer``) in range: integers in ``[least, most]``; reals ``> 0`` (or ``0`` with
    ``zero_ok``), at least :data:`FLAG_LEAST_POSITIVE` when not 0, at most ``most``. Used by the
    CLIs (``llmlab plan``, ``llmlab estimate``) so an error names the user's flag."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{flag} must be a finite number, got {value!r}")
    if integer:
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{flag} must be an integer >= {least:g}, got {value!r}")
        if value > most:
            raise ValueError(
                f"{flag} must be <= {most:,}, got {value:,}"
                if isinstance(most, int)
                else f"{flag} must be <= {most:g}, got {value}"
            )
        return
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{flag} must be {'>= 0' if zero_ok else '> 0'}, got {value:g}")
    if value > most or 0 < value < FLAG_LEAST_POSITIVE:
        raise ValueError(
            f"{flag} must be {'0 or ' if zero_ok else ''}between {FLAG_LEAST_POSITIVE:g} "
            f"and {most:g}, got {value:g}"
        )
