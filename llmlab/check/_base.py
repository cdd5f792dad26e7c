"""What every exercise check shares: the failure type and plain-words reporting.

Each ``check.<exercise>(fn)`` runs the learner's ``fn`` (on real ranks when the exercise is about
communication) and llmlab's reference on the same seed and data. On success it prints what was
checked and returns ``True``; otherwise it raises :class:`ExerciseFailed` saying in plain words
which rank and which value differ, what was expected and what came back, and a hint.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from llmlab.runtime.launch import RankError, launch


class ExerciseFailed(Exception):
    """The learner's function disagrees with the reference; the message says where and how."""


def _fail(name: str, what: str, expected, got, hint: str):
    raise ExerciseFailed(f"{name}: {what}\n  expected: {_show(expected)}\n  got:      {_show(got)}\n"
                         f"  hint: {hint}")


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
            hint = (f"the function is still the stub: write it in the cell above, or run "
                    f"exercises.reveal({name!r}) to use the solution and move on.")
        else:
            hint = ("every rank must take part in each send/recv/collective, in an order that "
                    "cannot leave two ranks waiting on each other.")
        raise ExerciseFailed(f"{name}: rank {e.rank} raised an error:\n{e.rank_traceback[-1500:]}\n"
                             f"  hint: {hint}") from None
    except TimeoutError as e:
        _remove_logs(e)
        raise ExerciseFailed(f"{name}: the ranks did not finish within 60 s (deadlock?)\n  hint: if "
                             f"every rank sends before it receives, blocking sends can wait forever; "
                             f"alternate the order on even and odd ranks.") from None
