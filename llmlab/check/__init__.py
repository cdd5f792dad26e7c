"""Checks for the learner exercises in :mod:`llmlab.exercises`, one module per lab.

Each ``check.<exercise>(fn)`` runs the learner's ``fn`` (on real ranks when the exercise is about
communication) and llmlab's reference on the same seed and data. On success it prints what was
checked and returns ``True``; otherwise it says in plain words which rank and which value differ,
what was expected and what came back, and a hint: it raises :class:`ExerciseFailed` with
``LLMLAB_SOLUTIONS=1`` or ``LLMLAB_STRICT=1``, else prints the message after a ✗ and returns
``False`` (see :mod:`llmlab.check._base`).
"""
from __future__ import annotations

import importlib

from llmlab.check._base import ExerciseFailed, reported
from llmlab.exercises import LABS, SOLUTIONS

for _lab in LABS:
    _mod = importlib.import_module(f"{__name__}.lab{_lab}")
    for _name in importlib.import_module(f"llmlab.exercises.lab{_lab}").EXERCISES:
        globals()[_name.__name__] = reported(_name.__name__, getattr(_mod, _name.__name__))

_missing = sorted(set(SOLUTIONS) - set(globals()))
if _missing:
    raise RuntimeError(f"exercises without a check: {', '.join(_missing)}")

__all__ = ["ExerciseFailed", *sorted(SOLUTIONS)]
