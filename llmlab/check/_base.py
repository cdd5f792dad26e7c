"""What every exercise check shares: the failure type and plain-words reporting.

Each ``check.<exercise>(fn)`` runs the learner's ``fn`` (on real ranks when the exercise is about
communication) and llmlab's reference on the same seed and data. On success it prints what was
checked and returns ``True``. Otherwise it says in plain words which rank and which value differ,
what was expected and what came back, and a hint; then

* with ``LLMLAB_SOLUTIONS=1`` (CI) or ``LLMLAB_STRICT=1`` it raises :class:`ExerciseFailed`;
* otherwise (a learner's Run All) it prints the message after a ✗ and returns ``False``, so the
  notebook goes on: :func:`llmlab.exercises.use` then hands the cells below llmlab's reference.

A function that is still the stub (raises ``NotImplementedError``), in the notebook or on a rank,
gets one message: :func:`stub_failure`; such a run is not an attempt, so it is not recorded in the
room's results (:mod:`llmlab.check.results`).
"""

from __future__ import annotations

import functools
import os
import shutil
import traceback
from pathlib import Path
from typing import NoReturn

import torch

from llmlab.check import results
from llmlab.runtime.launch import RankError, launch
from llmlab.solutions import solutions_on


class ExerciseFailed(Exception):
    """The learner's function disagrees with the reference; the message says where and how."""


class StubNotWritten(ExerciseFailed):
    """The learner's function is still the stub (it raises ``NotImplementedError``)."""


def strict() -> bool:
    """Whether a failed check raises (``LLMLAB_SOLUTIONS=1`` or ``LLMLAB_STRICT=1``)."""
    return solutions_on() or os.environ.get("LLMLAB_STRICT", "0") not in ("", "0", "false", "False")


def stub_failure(name: str) -> StubNotWritten:
    """The one message for a function that still raises ``NotImplementedError``."""
    return StubNotWritten(
        f"{name}: the function is still the stub (it raises NotImplementedError)\n"
        f"  hint: write it in the exercise cell and run the cell again, or run "
        f"exercises.reveal({name!r}) to use llmlab's solution."
    )


def reported(name: str, check_fn):
    """Wrap ``check_fn(fn, ...)`` so that a failure is reported as described in this module."""

    @functools.wraps(check_fn)
    def run(fn, *args, **kwargs) -> bool:
        err: ExerciseFailed
        try:
            ok = check_fn(fn, *args, **kwargs)
            results.record(name, bool(ok))
            return ok
        except NotImplementedError:
            err = stub_failure(name)
        except ExerciseFailed as e:
            err = e
        except Exception as e:  # the learner's function crashed in this process
            if strict():
                results.record(name, False, f"{type(e).__name__}: {e}")
                raise
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])
            err = ExerciseFailed(
                f"{name}: the function raised {type(e).__name__}: {e}\n{tb[-1500:]}"
                f"  hint: run it by hand on a small input to see where it fails."
            )
        if not isinstance(err, StubNotWritten):  # an untouched exercise is not an attempt
            results.record(name, False, str(err))
        if strict():
            raise err from None
        msg = str(err)
        if "exercises.reveal(" not in msg:
            msg += (
                f"\n  Fix the function and run this cell again, or run exercises.reveal({name!r}) to "
                f"switch this exercise to the solution."
            )
        print(f"✗ {msg}\n  The cells below use llmlab's reference solution, so the lab runs on.")
        return False

    return run


def _fail(name: str, what: str, expected, got, hint: str) -> NoReturn:
    raise ExerciseFailed(
        f"{name}: {what}\n  expected: {_show(expected)}\n  got:      {_show(got)}\n  hint: {hint}"
    )


def _show(v) -> str:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    s = repr(v)
    return s if len(s) < 300 else s[:300] + " ..."


def _ok(name: str, what: str) -> bool:
    print(f"✓ {name}: {what}")
    return True


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def _remove_logs(err) -> None:
    """Remove the per-rank log folder a failed launch kept (a learner's failed check would
    otherwise leave one in the temporary directory each time)."""
    log_dir = getattr(err, "log_dir", None)
    if log_dir and Path(log_dir).name.startswith("llmlab-logs-"):
        shutil.rmtree(log_dir, ignore_errors=True)


def _run_on_ranks(name: str, fn, world: int, *args):
    try:
        return launch(fn, world, *args, backend="gloo", timeout=60)
    except RankError as e:
        _remove_logs(e)  # the traceback is in the message below
        if "NotImplementedError" in e.rank_traceback:
            raise stub_failure(name) from None
        hint = (
            "every rank must take part in each send/recv/collective, in an order that "
            "cannot leave two ranks waiting on each other."
        )
        raise ExerciseFailed(
            f"{name}: rank {e.rank} raised an error:\n{e.rank_traceback[-1500:]}\n  hint: {hint}"
        ) from None
    except TimeoutError as e:
        _remove_logs(e)
        raise ExerciseFailed(
            f"{name}: the ranks did not finish within 60 s (deadlock?)\n  hint: if "
            f"every rank sends before it receives, blocking sends can wait forever; "
            f"alternate the order on even and odd ranks."
        ) from None
