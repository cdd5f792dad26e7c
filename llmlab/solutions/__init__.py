"""The exercise registry: every lab's reference solutions, by name, and the switch that turns
them on. It sits below both :mod:`llmlab.check` (which checks a function against these) and
:mod:`llmlab.exercises` (the notebooks' face: pick, check, use).

``llmlab/solutions/labNN.py`` holds lab NN's solutions (each docstring is the exercise statement)
and lists them in ``EXERCISES``; ``llmlab/check/labNN.py`` holds their checks, under the same names.
"""

from __future__ import annotations

import os

from llmlab.solutions import (
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

MODULES = {
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
LABS = tuple(MODULES)


def _registry() -> tuple[dict, dict]:
    solutions, lab_of = {}, {}
    for lab, mod in MODULES.items():
        for fn in mod.EXERCISES:
            if fn.__name__ in solutions:
                raise RuntimeError(f"exercise name {fn.__name__!r} is used by two labs")
            solutions[fn.__name__], lab_of[fn.__name__] = fn, lab
    return solutions, lab_of


SOLUTIONS, LAB_OF = _registry()  # exercise name -> reference solution; -> lab number ("00".."15")


def solutions_on() -> bool:
    """Whether ``LLMLAB_SOLUTIONS`` switches every exercise to its solution."""
    return os.environ.get("LLMLAB_SOLUTIONS", "0") not in ("", "0", "false", "False")
