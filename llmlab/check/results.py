"""Exercise results for the instructor (opt-in): each check's outcome, one small JSON file per learner.

With ``LLMLAB_RESULTS_DIR`` set (the classroom's hub sets it for every learner, see
docs/workshop.md), every ``llmlab.check.<exercise>(fn)`` records its outcome in
``$LLMLAB_RESULTS_DIR/<learner>.json``; ``llmlab classroom results DIR`` turns a room's files into a
table (:mod:`llmlab.classroom.results`). The learner is ``LLMLAB_LEARNER``, else
``JUPYTERHUB_USER``, else the login name. Nothing is written without the variable. The file::

    {"learner": "alice", "updated": 1767225600.0,
     "exercises": {"ring_all_reduce": {"solved": true, "attempts": 3, "first_solved": 1767225500.0,
                                       "last": 1767225600.0, "last_ok": true, "message": "..."}}}

Times are Unix seconds; ``message`` is the first line of the last failure ("" once solved).
Writes are atomic (a temporary file renamed over the old one) under a lock, so two kernels of one
learner cannot lose each other's records; a failure to write is reported on stderr and never fails
the check.
"""
from __future__ import annotations

import fcntl
import getpass
import json
import os
import re
import sys
import time
from pathlib import Path


def learner() -> str:
    """Who is running the checks: ``LLMLAB_LEARNER``, ``JUPYTERHUB_USER`` or the login name."""
    name = os.environ.get("LLMLAB_LEARNER") or os.environ.get("JUPYTERHUB_USER") or getpass.getuser()
    return re.sub(r"[^A-Za-z0-9_.@-]", "_", name)


def results_file() -> Path | None:
    """``$LLMLAB_RESULTS_DIR/<learner>.json``, or ``None`` when results are not recorded."""
    root = os.environ.get("LLMLAB_RESULTS_DIR")
    return Path(root) / f"{learner()}.json" if root else None


def record(exercise: str, ok: bool, message: str = "") -> None:
    """Add one outcome of ``exercise`` to this learner's file (no-op without ``LLMLAB_RESULTS_DIR``)."""
    path = results_file()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = json.loads(path.read_text()) if path.exists() else {}
            now = time.time()
            rows = data.setdefault("exercises", {})
            row = rows.setdefault(exercise, {"solved": False, "attempts": 0, "first_solved": None})
            row["attempts"] += 1
            row.update(last=now, last_ok=bool(ok), message="" if ok else message.strip().split("\n")[0][:300])
            if ok and not row["solved"]:
                row.update(solved=True, first_solved=now)
            data.update(learner=learner(), updated=now)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)
    except (OSError, ValueError) as e:
        print(f"llmlab: could not record the result of {exercise} in {path}: {e}", file=sys.stderr)
