"""PyTorch profiler traces with llmlab's phases named: one Chrome trace per rank.

:func:`phase` names a region of work (``llmlab.forward``, ``llmlab.all_reduce bytes=4096``,
``llmlab.pp F chunk=0 mb=1``) with ``torch.profiler.record_function`` while a profiler is
recording, and is a shared no-op context otherwise (one C++ flag read: profiling off costs
nothing measurable). :class:`StepProfiler` records steps ``A..B`` of a loop with
``torch.profiler.profile(schedule=..., on_trace_ready=...)`` and writes
``DIR/rank{R}.pt.trace.json.gz``: it opens in Perfetto (ui.perfetto.dev), in TensorBoard's
profiler plugin and in Holistic Trace Analysis (``hta.trace_analysis.TraceAnalysis``), which
reads the rank from the trace's ``distributedInfo``.

Source: PyTorch profiler recipe (torch.profiler.schedule, tensorboard_trace_handler); the
phase names follow what Megatron-LM's and torchtitan's traces show (forward, backward,
optimizer, each collective with its message size).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import Any, ContextManager

import torch

PREFIX = "llmlab."
_OFF: ContextManager[None] = contextlib.nullcontext()
_RECORDINGS = itertools.count(1)


def phase(name: str, **args: object) -> ContextManager[Any]:
    """A context naming ``name`` (and ``key=value`` of ``args``) in the trace being recorded;
    ``contextlib.nullcontext`` when no profiler is on."""
    if not torch.autograd._profiler_enabled():
        return _OFF
    label = PREFIX + name + "".join(f" {k}={v}" for k, v in args.items())
    return torch.profiler.record_function(label)


def parse_steps(spec: str, first: int, last: int) -> tuple[int, int]:
    """``"A:B"`` (or ``"A"``) -> ``(A, B)``, steps ``A..B`` inclusive and 1-based. Raises
    ``ValueError`` naming ``--profile-steps`` for a malformed range or one outside ``first..last``."""
    parts = spec.split(":")
    try:
        a, b = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        a = b = None
    if a is None or b is None:
        raise ValueError(f"--profile-steps {spec!r}: expected A:B (first and last step to record, e.g. 2:3)")
    if not first <= a <= b <= last:
        raise ValueError(
            f"--profile-steps {spec!r}: the range must lie within the run's steps "
            f"{first}..{last}, with A <= B"
        )
    return a, b


def check_dir(path: str, flag: str = "--profile-dir") -> None:
    """Create ``path`` and check it is writable; ``ValueError`` naming ``flag`` otherwise."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path!r} is a file; it must be a folder (or not exist yet)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path!r} cannot be created: {e.strerror}") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r} is not writable")


def trace_path(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank``'s trace goes: ``DIR/rank{rank}.pt.trace.json.gz``."""
    return Path(directory) / f"rank{rank}.pt.trace.json.gz"


def profiler(out: str | Path, skip: int = 0, active: int | None = None) -> torch.profiler.profile:
    """A ``torch.profiler.profile`` recording CPU (and CUDA, when present) activity with shapes,
    writing the Chrome trace ``out`` when its active window ends. With ``active`` set, the
    schedule skips ``skip`` calls of ``step()`` and records the next ``active`` ones; without, it
    records from ``start()`` to ``stop()``. The profiler is per thread: start it in the thread
    whose work it should see."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)

    def write(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(out))

    sched = None
    if active is not None:
        sched = torch.profiler.schedule(skip_first=skip, wait=0, warmup=0, active=active, repeat=1)
    return torch.profiler.profile(activities=acts, schedule=sched, on_trace_ready=write, record_shapes=True)


class StepProfiler:
    """Records steps ``a..b`` of a loop that starts at step ``first``: call :meth:`step` after
    every step, :meth:`close` at the end. ``directory=None``: does nothing."""

    def __init__(self, directory: str | None, rank: int, steps: tuple[int, int] | None, first: int):
        self.prof = None
        if directory and steps and steps[1] >= first:
            import warnings

            a, b = max(steps[0], first), steps[1]  # a resumed run starts at ``first``
            with warnings.catch_warnings():  # "no warmup": wanted, step A is recorded as is
                warnings.simplefilter("ignore")
                self.prof = profiler(trace_path(directory, rank), skip=a - first, active=b - a + 1)
                self.prof.start()

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None


class TraceRecorder:
    """Start/stop recording on demand (the engine's ``start_profile``/``stop_profile``, as vLLM's):
    each recording becomes ``DIR/{name}-{n}.pt.trace.json.gz``, ``n`` = 1, 2, ... counted per
    process (the server's engine replicas share one folder)."""

    def __init__(self, directory: str | None, name: str = "engine"):
        self.directory, self.name, self.path = directory, name, ""
        self.prof: torch.profiler.profile | None = None

    def start(self) -> None:
        """``RuntimeError`` without a folder or while recording."""
        if not self.directory:
            raise RuntimeError(
                "profiling needs a trace folder: start the engine with "
                "--profile-dir DIR (EngineConfig.profile_dir)"
            )
        if self.prof is not None:
            raise RuntimeError("a profile is already being recorded; stop it first")
        self.path = str(Path(self.directory) / f"{self.name}-{next(_RECORDINGS)}.pt.trace.json.gz")
        self.prof = profiler(self.path)
        self.prof.start()

    def stop(self) -> str:
        """Write the trace; returns its path. ``RuntimeError`` when not recording."""
        if self.prof is None:
            raise RuntimeError("no profile is being recorded; start one first")
        prof, self.prof = self.prof, None
        prof.stop()
        return self.path
