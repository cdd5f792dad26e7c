"""A learner's Jupyter server, started by the hub: ``python -m llmlab.classroom.singleuser [args]``.

It runs as the learner, before ``jupyterhub-singleuser`` (which it then becomes, with ``args``):

* pins itself to the seat's cores (``LLMLAB_CPU_CORES``, set by the hub from
  :class:`llmlab.classroom.seats.Seat`); kernels and the ranks a lab launches inherit the affinity,
  and :func:`llmlab.runtime.hardware.usable_cores` counts only those cores;
* copies the labs (``LLMLAB_LABS_SOURCE``) into ``~/labs`` the first time, and never again, so a
  learner's edits survive a restart.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def pin(cores: str) -> None:
    """Restrict this process (and everything it starts) to the comma-separated core ids ``cores``."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})


def copy_labs(source: str, home: Path) -> None:
    """Copy the notebooks of ``source`` to ``home/labs`` unless that folder exists."""
    dest = home / "labs"
    if source and not dest.exists():
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))


def main(argv: list[str]) -> None:
    pin(os.environ.get("LLMLAB_CPU_CORES", ""))
    copy_labs(os.environ.get("LLMLAB_LABS_SOURCE", ""), Path(os.environ.get("HOME") or Path.home()))
    os.execv(sys.executable, [sys.executable, "-m", "jupyterhub.singleuser", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
