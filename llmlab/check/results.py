"""Exercise results for the instructor (opt-in): each check's outcome, in the learner's own folder.

With ``LLMLAB_RESULTS_DIR`` set (the classroom's hub sets it for every learner, see
docs/workshop.md), every ``llmlab.check.<exercise>(fn)`` records its outcome in
``$LLMLAB_RESULTS_DIR/<learner>/results.json``; ``llmlab classroom results DIR`` turns a room's
folders into a table (:mod:`llmlab.classroom.results`). ``<learner>`` is :func:`folder_name` of
``LLMLAB_LEARNER``, else ``JUPYTERHUB_USER``, else the login name. Nothing is written without the
variable. A run of an exercise that is still the stub is not an attempt and is not recorded. The file::

    {"learner": "alice", "updated": 1767225600.0,
     "exercises": {"ring_all_reduce": {"solved": true, "attempts": 3, "first_solved": 1767225500.0,
                                       "last": 1767225600.0, "last_ok": true, "message": "..."}}}

Times are Unix seconds; ``message`` is the first line of the last failure ("" once solved).

Whose results these are is decided by the reader from the folder's owner, not from what the file
says: the folder must be this process's user's own (the hub makes it for each learner; without a
hub it is made here, mode 0700, in a shared sticky folder). Nothing here follows a link: the
folder is opened with ``O_NOFOLLOW``, the lock too, and a new record is written to a file created
exclusively (``O_EXCL|O_NOFOLLOW``) and renamed over the old one, under the lock, so two kernels of
one learner cannot lose each other's records. A failure to write is reported on stderr and never
fails the check.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import secrets
import stat
import sys
import time
from pathlib import Path

from llmlab.classroom.isolation import MAX_BYTES, RECORD, folder_name

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


def learner() -> str:
    """Who is running the checks: ``LLMLAB_LEARNER``, ``JUPYTERHUB_USER`` or the login name."""
    return folder_name(
        os.environ.get("LLMLAB_LEARNER") or os.environ.get("JUPYTERHUB_USER") or getpass.getuser()
    )


def results_file() -> Path | None:
    """``$LLMLAB_RESULTS_DIR/<learner>/results.json``, or ``None`` when results are not recorded."""
    root = os.environ.get("LLMLAB_RESULTS_DIR")
    return Path(root) / learner() / RECORD if root else None


def _own_folder(folder: Path) -> int:
    """An fd of ``folder``, made (0700) if missing. Raises ``PermissionError`` when it is a link,
    not a folder, or another user's (someone took the name: the instructor removes it)."""
    folder.parent.mkdir(parents=True, exist_ok=True)  # a results folder of one's own (no hub)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _OPEN)  # a link: ELOOP
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(
            f"{folder} belongs to uid {st.st_uid}, not to this learner (uid "
            f"{os.geteuid()}): ask the instructor to remove it"
        )
    return fd


def _read_record(dir_fd: int) -> dict:
    """The learner's record in the folder ``dir_fd`` ({} if none; a file that is not a regular
    one, is too large or does not parse starts a fresh record)."""
    try:
        fd = os.open(RECORD, os.O_RDONLY | os.O_NONBLOCK | _OPEN, dir_fd=dir_fd)
    except FileNotFoundError:
        return {}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return {}
        try:
            data = json.loads(f.read(MAX_BYTES))
        except ValueError:
            return {}
    return data if isinstance(data, dict) and isinstance(data.get("exercises"), dict) else {}


def _write_record(dir_fd: int, data: dict) -> None:
    tmp = f".{RECORD}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1))
        os.replace(tmp, RECORD, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise


def record(exercise: str, ok: bool, message: str = "") -> None:
    """Add one outcome of ``exercise`` to this learner's record (no-op without ``LLMLAB_RESULTS_DIR``)."""
    path = results_file()
    if path is None:
        return
    try:
        dir_fd = _own_folder(path.parent)
        try:
            lock = os.open(".lock", os.O_RDWR | os.O_CREAT | _OPEN, 0o600, dir_fd=dir_fd)
            with os.fdopen(lock, "r+") as lk:
                fcntl.flock(lk, fcntl.LOCK_EX)
                data = _read_record(dir_fd)
                now = time.time()
                rows = data.setdefault("exercises", {})
                row = rows.setdefault(exercise, {"solved": False, "attempts": 0, "first_solved": None})
                row["attempts"] += 1
                row.update(
                    last=now, last_ok=bool(ok), message="" if ok else message.strip().split("\n")[0][:300]
                )
                if ok and not row["solved"]:
                    row.update(solved=True, first_solved=now)
                data.update(learner=learner(), updated=now)
                _write_record(dir_fd, data)
        finally:
            os.close(dir_fd)
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"llmlab: could not record the result of {exercise} in {path}: {e}", file=sys.stderr)
