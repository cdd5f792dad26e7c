"""What keeps the learners of a room apart, checked by the hub before it listens or starts a server.

The isolated room (``LLMLAB_HUB_MODE=system``, docs/workshop.md section 3) follows JupyterHub's
own deployment advice: every learner's server runs as that learner's Unix account (never root, never
a system account), in a private home; the hub's secrets (its database, cookie secret, the
instructor's token, the proxy's token) stay with root; the public address is explicit and served
over TLS. This module holds the checks and file operations the recipe
(``classroom/jupyterhub_config.py``) runs as root:

* :func:`bind_error`: which addresses a mode may listen on (demo mode: loopback only; anything
  else only with TLS);
* :func:`unreachable`: a path (the Python of the learners' servers, the labs) that another
  account cannot reach;
* :func:`learner_account`, :func:`private_home`: the learner's account, and its home made 0700;
* :func:`folder_name`, :func:`results_folder`: the learner's own folder of the room's results, made by the hub, so that
  no learner can make, squat or replace another's (:mod:`llmlab.check.results` writes into it).
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import re
import socket
import stat
import time
from pathlib import Path

UID_MIN = 1000  # the first uid of a person's account (login.defs); below: root and system accounts
RECORD = "results.json"  # a learner's record in their results folder (llmlab.check.results)
MAX_BYTES = 1 << 20  # a record never grows past this (llmlab classroom results skips a larger one)


def folder_name(name: str) -> str:
    """``name`` as a results folder's name: characters other than letters, digits and ``_.@-``
    become ``_``, at most 100 of them, and a leading dot (``.``, ``..``, hidden names) gets a ``_``
    in front."""
    safe = re.sub(r"[^A-Za-z0-9_.@-]", "_", name)[:100] or "_"
    return "_" + safe if safe.startswith(".") else safe


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) resolves only to loopback addresses."""
    if host in ("", "0.0.0.0", "::", "*"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def bind_error(mode: str, host: str, tls: bool) -> str | None:
    """Why the hub of ``mode`` may not listen on ``host`` (``None`` when it may).

    Demo mode runs every learner's server as the hub's own user, so each learner can read the
    hub's environment and files (the instructor's token, the room password): it is for one
    machine's own browser only, loopback. The isolated mode may listen on other addresses only
    with TLS (``tls``), since PAM logins send the learners' Unix passwords."""
    if is_loopback(host):
        return None
    if mode == "demo":
        return (
            f"demo mode cannot isolate learners (every server runs as the hub's user and can read "
            f"the hub's secrets), so it listens on loopback only, not {host or 'every interface'}: "
            f"use LLMLAB_HUB_MODE=system for a room, or reach this hub through an SSH tunnel"
        )
    if not tls:
        return (
            f"the hub would send learners' passwords in clear on {host or 'every interface'}: give "
            f"LLMLAB_HUB_SSL_CERT and LLMLAB_HUB_SSL_KEY (TLS), or bind 127.0.0.1 behind a reverse "
            f"proxy that serves TLS (docs/workshop.md, section 3)"
        )
    return None


def unreachable(path: str | Path) -> Path | None:
    """The first folder on the way to ``path`` (or ``path`` itself) that an account other than its
    owner cannot search or read (no ``o+x`` on a folder, no ``o+r`` on the file), else ``None``.
    The learners' servers run this Python and copy these labs as their own users."""
    p = Path(path).resolve()
    for folder in [*reversed(p.parents), p]:
        mode = folder.stat().st_mode
        need = stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH
        if not mode & need:
            return folder
    return None


def learner_account(name: str) -> pwd.struct_passwd:
    """The Unix account of learner ``name``. Raises ``PermissionError`` for root or a system
    account (uid below 1000): a learner's server never runs as one; ``KeyError`` when there is none."""
    pw = pwd.getpwnam(name)
    if pw.pw_uid < UID_MIN:
        raise PermissionError(
            f"refusing to start a learner's server as {name!r} (uid {pw.pw_uid}): "
            f"learners are person accounts (uid >= {UID_MIN}), never root or a "
            f"system account"
        )
    return pw


def private_home(pw: pwd.struct_passwd) -> None:
    """Make the learner's home ``0700`` (other learners can neither list nor read it). Only a real
    folder owned by the learner is touched; anything else is refused with ``PermissionError``."""
    st = os.lstat(pw.pw_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != pw.pw_uid:
        raise PermissionError(
            f"{pw.pw_dir} is not a folder owned by {pw.pw_name}: not starting a server there"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(pw.pw_dir, stat.S_IMODE(st.st_mode) & 0o700)


def results_folder(root: str | Path, folder: str, uid: int, gid: int) -> Path:
    """Make ``root/folder`` the learner's own results folder (owner ``uid``, mode 0700), as root.

    ``root`` must be owned by this process's user and writable by nobody else (the hub makes it
    0711: learners pass through but cannot list it or create anything in it). Whatever already
    sits at that name and is not a real folder of this learner (a link, a file, another
    learner's folder) is moved aside to ``.squatted-<folder>-<time>``, never followed."""
    root = Path(root)
    st = os.lstat(root)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        raise PermissionError(
            f"the results folder {root} must belong to the hub's user and be writable "
            f"by it alone (it is mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})"
        )
    path = root / folder
    try:
        old = os.lstat(path)
    except FileNotFoundError:
        old = None
    if old is not None and not (stat.S_ISDIR(old.st_mode) and old.st_uid == uid):
        os.rename(path, root / f".squatted-{folder}-{time.time_ns()}")
        old = None
    if old is None:
        os.mkdir(path, 0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path
