"""``llmlab classroom results DIR``: a room's exercise results as one table (who solved which exercise).

``DIR`` holds one JSON file per learner, written by :mod:`llmlab.check.results` when the learners'
kernels have ``LLMLAB_RESULTS_DIR=DIR`` (the classroom's hub sets it). One row per learner, one
column per exercise; a cell is ``ok`` (solved; ``ok/3``: after 3 attempts), ``x3`` (3 attempts, none
passed yet: where the room is stuck) or ``.`` (not tried). The last row counts who solved each
exercise. ``--json`` prints ``{"exercises": [...], "learners": {name: {exercise: row}}}`` instead.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load_room(folder: str | Path) -> dict[str, dict]:
    """``{learner: {exercise: row}}`` from every ``*.json`` of ``folder`` (rows as written by
    :func:`llmlab.check.results.record`). Raises ``FileNotFoundError`` if ``folder`` is not a
    directory; a file that is not a results file is named on stderr and skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no results directory {folder}")
    room = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            room[data.get("learner") or path.stem] = dict(data["exercises"])
        except (ValueError, KeyError, TypeError, OSError) as e:
            print(f"llmlab classroom results: skipping {path.name}: not a results file ({e})", file=sys.stderr)
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
    """The table described in this module's docstring, as fixed-width text."""
    exercises = exercise_order(room)
    header = ["learner", *exercises]
    rows = [[name, *(cell(room[name].get(e)) for e in exercises)] for name in sorted(room)]
    solved = [sum(bool(room[n].get(e, {}).get("solved")) for n in room) for e in exercises]
    rows.append([f"solved (of {len(room)})", *map(str, solved)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("dir", help="the room's results directory (LLMLAB_RESULTS_DIR of the learners)")
    p.add_argument("--json", action="store_true", help="print the room as JSON instead of a table (default: off)")


def run(args) -> int:
    room = load_room(args.dir)
    if args.json:
        print(json.dumps({"exercises": exercise_order(room), "learners": room}, indent=1))
    elif not room:
        print(f"no results in {args.dir} yet")
    else:
        print(format_table(room))
    return 0
