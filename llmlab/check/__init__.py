"""Checks for the learner exercises in :mod:`llmlab.exercises`, one module per lab.

Each ``check.<exercise>(fn)`` runs the learner's ``fn`` (on real ranks when the exercise is about
communication) and llmlab's reference on the same seed and data. On success it prints what was
checked and returns ``True``; otherwise it says in plain words which rank and which value differ,
what was expected and what came back, and a hint: it raises :class:`ExerciseFailed` with
``LLMLAB_SOLUTIONS=1`` or ``LLMLAB_STRICT=1``, else prints the message after a ✗ and returns
``False`` (see :mod:`llmlab.check._base`).
"""

from __future__ import annotations

from llmlab.check import (
    lab00,
    lab01,
    lab02,
    lab03,
    lab04,
    lab05,
    lab06,
    lab07,
    lab08,
    lab09,
    lab10,
    lab11,
    lab12,
    lab15,
)
from llmlab.check._base import ExerciseFailed, reported
from llmlab.solutions import LAB_OF, SOLUTIONS

_MODULES = {
    "00": lab00,
    "01": lab01,
    "02": lab02,
    "03": lab03,
    "04": lab04,
    "05": lab05,
    "06": lab06,
    "07": lab07,
    "08": lab08,
    "09": lab09,
    "10": lab10,
    "11": lab11,
    "12": lab12,
    "15": lab15,
}
_missing = sorted(n for n, lab in LAB_OF.items() if not hasattr(_MODULES[lab], n))
if _missing:
    raise RuntimeError(f"exercises without a check: {', '.join(_missing)}")
# exercise name -> its check, reporting failures as llmlab.check._base describes
CHECKS = {n: reported(n, getattr(_MODULES[lab], n)) for n, lab in LAB_OF.items()}

__all__ = ["CHECKS", "ExerciseFailed", *sorted(SOLUTIONS)]


def __getattr__(name: str):
    """``llmlab.check.<exercise>``: that exercise's check."""
    try:
        return CHECKS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(CHECKS))
