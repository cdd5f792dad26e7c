"""Learner exercises: the stubs' contracts and their reference solutions, one module per lab.

Each lab has exercise cells: the learner writes a function, then a :mod:`llmlab.check` helper runs
it (on real ranks where communication is the point) against the reference solution on the same
seed and data, and says in plain words what differs. The labs run with solutions switched on in CI.

``llmlab/exercises/labNN.py`` holds lab NN's solutions (each docstring is the exercise statement)
and lists them in ``EXERCISES``; ``llmlab/check/labNN.py`` holds their checks, under the same names.

Switching:

* ``LLMLAB_SOLUTIONS=1`` in the environment: every exercise uses its reference solution;
* ``llmlab.exercises.reveal("name")``: this one exercise uses the solution (to move on);
* otherwise :func:`pick` returns the learner's own function.

In a notebook::

    def ring_reduce_scatter(chunks, rank, world):
        ...  # your code
    ring_reduce_scatter = exercises.use("ring_reduce_scatter", ring_reduce_scatter)

:func:`use` picks, runs the check, and returns what the cells below should call: the picked
function if the check passed, llmlab's reference if it failed (the check printed ✗ and why), so
Run All never stops at an unsolved exercise. With ``LLMLAB_SOLUTIONS=1`` or ``LLMLAB_STRICT=1`` a
failed check raises instead.
"""
from __future__ import annotations

import importlib
import os

LABS = ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11")

SOLUTIONS: dict = {}  # exercise name -> reference solution
LAB_OF: dict[str, str] = {}  # exercise name -> lab number ("00".."11")
for _lab in LABS:
    for _fn in importlib.import_module(f"{__name__}.lab{_lab}").EXERCISES:
        if _fn.__name__ in SOLUTIONS:
            raise RuntimeError(f"exercise name {_fn.__name__!r} is used by two labs")
        SOLUTIONS[_fn.__name__] = _fn
        LAB_OF[_fn.__name__] = _lab
globals().update(SOLUTIONS)  # llmlab.exercises.<name> is the reference solution

_revealed: set[str] = set()


def solutions_on() -> bool:
    """Whether ``LLMLAB_SOLUTIONS`` switches every exercise to its solution."""
    return os.environ.get("LLMLAB_SOLUTIONS", "0") not in ("", "0", "false", "False")


def _known(name: str) -> None:
    if name not in SOLUTIONS:
        raise KeyError(f"no exercise named {name!r}; exercises: {', '.join(sorted(SOLUTIONS))}")


def reveal(name: str) -> None:
    """Use the reference solution for exercise ``name`` from now on (raises ``KeyError`` if unknown)."""
    _known(name)
    _revealed.add(name)


def pick(name: str, learner_fn):
    """The function to check/use: the solution if switched on, else the learner's.

    Raises ``KeyError`` naming the known exercises if ``name`` is not one."""
    _known(name)
    return SOLUTIONS[name] if (solutions_on() or name in _revealed) else learner_fn


def use(name: str, learner_fn):
    """Pick (see :func:`pick`), check with ``llmlab.check.<name>``, and return the function to use
    from here on: the picked one if its check passed, else the reference solution.

    Raises ``KeyError`` for an unknown ``name``; :class:`llmlab.check.ExerciseFailed` when the
    check fails under ``LLMLAB_SOLUTIONS=1`` or ``LLMLAB_STRICT=1``."""
    from llmlab import check  # check imports this module
    fn = pick(name, learner_fn)
    return fn if getattr(check, name)(fn) else SOLUTIONS[name]
