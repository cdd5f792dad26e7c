"""``llmlab classroom results DIR``: a room's exercise results as one table (who solved which exercise).

``DIR`` holds one folder per learner, ``<learner>/results.json``, written by
:mod:`llmlab.check.results` when the learners' kernels have ``LLMLAB_RESULTS_DIR=DIR`` (the
classroom's hub sets it and makes each learner's folder). One row per learner, one column per
exercise; a cell is ``ok`` (solved; ``ok/3``: after 3 attempts), ``x3`` (3 attempts, none passed
yet: where the room is stuck) or ``.`` (not tried). The last row counts who solved each exercise.
``--json`` prints ``{"exercises": [...], "learners": {name: {exercise: row}}}`` instead.

What a row says is trusted only as far as the file system vouches for it: a row is the learner's
whose Unix account owns the folder and the file (a folder named after someone else is a foreign
row, skipped; folders owned by ``DIR``'s own owner, the hub's user in a demo room where every
server runs as it, are taken by their name). Only real folders and regular files are read, never
through a link and never waiting on a FIFO, at most :data:`~llmlab.check.results.MAX_BYTES` each;
anything else (a link, a FIFO, an oversized, malformed or foreign record) is named on stderr and
skipped, and the table is printed anyway. Names are printed with control characters escaped.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pwd
import stat
import sys
from pathlib import Path

from llmlab.classroom.isolation import MAX_BYTES, RECORD

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def printable(s: str) -> str:
    """``s`` with every non-printable character (control characters, escape sequences, line and
    format characters) written as its Python escape: what the instructor's terminal shows as is."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


def _account(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def _time(v) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"a time is {v!r}, not Unix seconds")
    return float(v)


def _rows(data) -> dict[str, dict]:
    """The validated rows of a record; ``ValueError`` naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("exercises"), dict):
        raise ValueError(f"{RECORD} has no 'exercises' object")
    rows = {}
    for name, row in data["exercises"].items():
        if not isinstance(row, dict):
            raise ValueError(f"exercise {name!r} is not an object")
        attempts, solved = row.get("attempts", 1), row.get("solved", False)
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 0:
            raise ValueError(f"exercise {name!r}: attempts {attempts!r} is not a count")
        last_ok = row.get("last_ok", solved)
        if not all(
            isinstance(v, t) for v, t in ((solved, bool), (last_ok, bool), (row.get("message", ""), str))
        ):
            raise ValueError(f"exercise {name!r}: 'solved', 'last_ok' or 'message' has the wrong type")
        rows[name] = {
            "solved": solved,
            "attempts": attempts,
            "first_solved": _time(row.get("first_solved")),
            "last": _time(row.get("last")),
            "last_ok": last_ok,
            "message": row.get("message", ""),
        }
    return rows


def _read_folder(root_fd: int, name: str, trusted_uid: int) -> dict[str, dict]:
    """The rows of learner folder ``name`` (in the folder ``root_fd``); ``ValueError`` saying why
    it is not a learner's record."""
    try:
        dfd = os.open(name, _OPEN | os.O_DIRECTORY, dir_fd=root_fd)
    except OSError as e:
        kind = os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode
        what = (
            "a link"
            if stat.S_ISLNK(kind)
            else "not a learner's folder"
            if not stat.S_ISDIR(kind)
            else e.strerror
        )
        raise ValueError(what) from None
    try:
        owner = os.fstat(dfd).st_uid
        account = _account(owner)
        if owner != trusted_uid and account != name:
            raise ValueError(
                f"foreign: the folder belongs to {printable(account or str(owner))}, not to {printable(name)}"
            )
        try:
            fd = os.open(RECORD, _OPEN, dir_fd=dfd)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise ValueError(
                f"{RECORD} is a link" if e.errno == errno.ELOOP else f"{RECORD}: {e.strerror}"
            ) from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{RECORD} is not a regular file")
            if st.st_uid != owner:
                raise ValueError(f"foreign: {RECORD} belongs to uid {st.st_uid}, not to the folder's owner")
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise ValueError(f"{RECORD} is larger than {MAX_BYTES} bytes")
        try:
            data = json.loads(data)
        except ValueError as e:
            raise ValueError(f"{RECORD} is not JSON ({e})") from None
        return _rows(data)
    finally:
        os.close(dfd)


def load_room(folder: str | Path) -> dict[str, dict]:
    """``{learner: {exercise: row}}`` from every learner folder of ``folder`` (rows as written by
    :func:`llmlab.check.results.record`). Raises ``FileNotFoundError`` if ``folder`` is not a
    directory; every entry that is not a learner's own well-formed record is named on stderr and
    skipped (see this module's docstring)."""
    try:
        root_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"no results directory {folder}") from None
    room = {}
    try:
        trusted = os.fstat(root_fd).st_uid
        for name in sorted(os.listdir(root_fd)):
            if name.startswith("."):
                continue
            try:
                room[name] = _read_folder(root_fd, name, trusted)
            except (ValueError, OSError) as e:
                print(f"llmlab classroom results: skipping {printable(name)}: {e}", file=sys.stderr)
    finally:
        os.close(root_fd)
    return room


def exercise_order(room: dict[str, dict]) -> list[str]:
    """Exercises in the order the room met them: the earliest first success (else last try) across learners."""
    first: dict[str, float] = {}
    for rows in room.values():
        for name, row in rows.items():
            t = row.get("first_solved") or row.get("last") or 0.0
            first[name] = min(first.get(name, t), t)
    return sorted(first, key=lambda n: (first[n], n))


def cell(row: dict | None) -> str:
    if not row:
        return "."
    if row.get("solved"):
        return "ok" if row.get("attempts", 1) <= 1 else f"ok/{row['attempts']}"
    return f"x{row.get('attempts', 1)}"


def format_table(room: dict[str, dict]) -> str:
    """The table described in this module's docstring, as fixed-width text (names escaped)."""
    exercises = exercise_order(room)
    header = ["learner", *map(printable, exercises)]
    rows = [[printable(name), *(cell(room[name].get(e)) for e in exercises)] for name in sorted(room)]
    solved = [sum(bool(room[n].get(e, {}).get("solved")) for n in room) for e in exercises]
    rows.append([f"solved (of {len(room)})", *map(str, solved)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("dir", help="the room's results directory (LLMLAB_RESULTS_DIR of the learners)")
    p.add_argument(
        "--json", action="store_true", help="print the room as JSON instead of a table (default: off)"
    )


def run(args) -> int:
    room = load_room(args.dir)
    if args.json:
        print(json.dumps({"exercises": exercise_order(room), "learners": room}, indent=1))
    elif not room:
        print(f"no results in {printable(str(args.dir))} yet")
    else:
        print(format_table(room))
    return 0
