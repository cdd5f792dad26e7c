"""Learner exercises: the stubs' contracts and their reference solutions, one module per lab.

Each lab has exercise cells: the learner writes a function, then a :mod:`llmlab.check` helper runs
it (on real ranks where communication is the point) against the reference solution on the same
seed and data, and says in plain words what differs. The labs run with solutions switched on in CI.

``llmlab/solutions/labNN.py`` holds lab NN's solutions (each docstring is the exercise statement;
:mod:`llmlab.solutions` is the registry of them); ``llmlab/check/labNN.py`` holds their checks,
under the same names. This module is the notebooks' face over both.

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

from llmlab.check import CHECKS
from llmlab.solutions import LAB_OF, LABS, SOLUTIONS, solutions_on

__all__ = ["LABS", "LAB_OF", "SOLUTIONS", "solutions_on", "reveal", "pick", "use", *sorted(SOLUTIONS)]

_revealed: set[str] = set()


def __getattr__(name: str):
    """``llmlab.exercises.<name>``: that exercise's reference solution."""
    try:
        return SOLUTIONS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SOLUTIONS))


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
    fn = pick(name, learner_fn)
    return fn if CHECKS[name](fn) else SOLUTIONS[name]
