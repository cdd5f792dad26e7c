"""What this CPU offers the CPU fast paths: one instruction-set level, read once, lowered on request.

Each CPU fast path chooses by it and falls back where the CPU cannot run the fast one
(docs/kernels.md lists which instructions each uses):

* the prepacked oneDNN linear (:mod:`~llmlab.kernels.cpu_linear`) packs bf16 weights only with
  AVX-512 BW/VL/DQ (or AVX-NE-CONVERT) and fp16 ones only with AVX512-FP16 (or AVX-NE-CONVERT),
  which is what PyTorch's oneDNN ops require; elsewhere it keeps ``F.linear``;
* the C++ kernels (:mod:`~llmlab.kernels.cpu_build`) are compiled for the level: its own CPU
  (``-march=native``) at the detected level, ``x86-64-v4``, ``x86-64-v3`` or ``x86-64`` when lowered;
  PagedAttention's bf16 dot products use AVX512-BF16 only where the build has it.

Levels, lowest first (:data:`LEVELS`): ``generic`` (no vector extension assumed: SSE2 on x86-64,
any other machine), ``avx2`` (AVX2, FMA, F16C: x86-64-v3, e.g. AMD EPYC before Zen 4),
``avx512`` (AVX-512 F/BW/VL/DQ: x86-64-v4), ``avx512_bf16`` (plus AVX512-BF16).

``LLMLAB_CPU_ISA=<level>`` makes this process (and its children) choose as a CPU of that level
would: ``LLMLAB_CPU_ISA=avx2`` on an AVX-512 machine takes every AVX2 fallback, so a developer on a
big machine can run the suite as a small one does. It can lower the level, not raise it
(``ValueError``: code for instructions the CPU lacks would die with SIGILL).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from pathlib import Path

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")
ENV = "LLMLAB_CPU_ISA"
# The flags (as /proc/cpuinfo spells them) each level adds to the one below it.
REQUIRES = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_bf16": frozenset({"avx512_bf16"}),
}
# Flags above each level: removed from the effective set when the level is lowered to it.
_ABOVE_AVX2 = ("avx512", "amx", "avx_ne_convert", "avx_vnni_int", "avx10")
_ABOVE_GENERIC = ("avx", "fma", "f16c") + _ABOVE_AVX2


def _torch_flags() -> frozenset[str]:
    """Flags implied by PyTorch's own CPU capability probe (where there is no /proc/cpuinfo)."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    flags = set(REQUIRES["avx2"]) if cap in ("AVX2", "AVX512") else set()
    return frozenset(flags | (REQUIRES["avx512"] if cap == "AVX512" else set()))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``'s ``flags`` line, lower case), or those
    implied by ``torch.backends.cpu.get_cpu_capability()`` where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return _torch_flags()


def level_of(flags: frozenset[str] | set[str]) -> str:
    """The highest level of :data:`LEVELS` whose flags (cumulative :data:`REQUIRES`) are all in
    ``flags``."""
    best, need = "generic", set[str]()
    for level in LEVELS[1:]:
        need |= REQUIRES[level]
        if not need <= set(flags):
            break
        best = level
    return best


@functools.cache
def detected() -> str:
    """This CPU's level, before any :data:`ENV` override."""
    return level_of(cpu_flags())


def fallback() -> str | None:
    """The level below the current one (:func:`cpu_isa`) whose fallbacks the tests force:
    ``avx2`` under AVX-512, ``generic`` under AVX2, ``None`` at ``generic``."""
    found = LEVELS.index(cpu_isa())
    return None if found == 0 else ("avx2" if found > 1 else "generic")


@functools.cache
def _resolve(override: str | None, found: str) -> str:
    if not override:
        return found
    level = override.strip().lower()
    if level not in LEVELS:
        raise ValueError(f"{ENV}={override!r} must be one of {', '.join(LEVELS)}")
    if LEVELS.index(level) > LEVELS.index(found):
        raise ValueError(
            f"{ENV}={override!r} asks for more than this CPU offers ({found}): it can only lower the level"
        )
    return level


# The level :func:`pinned` holds for the code it wraps (this thread's or task's), else None.
_PINNED: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmlab_cpu_isa_pinned", default=None)


def cpu_isa() -> str:
    """The level the fast paths choose by: :func:`detected`, or :data:`ENV` where set
    (``ValueError`` for an unknown level or one above this CPU's); inside :func:`pinned`, the
    level it read on entry."""
    level = _PINNED.get()
    if level is not None:
        return level
    return _resolve(os.environ.get(ENV) or None, detected())


@contextlib.contextmanager
def pinned() -> Iterator[str]:
    """``with pinned() as level:`` inside, :func:`cpu_isa` is ``level`` (read once, on entry)
    for this thread (or asyncio task) without reading :data:`ENV` again. An engine step's
    forward runs inside one: its few hundred kernel calls each chose by an environment read
    (about 1 us apiece), and a level lowered during a step could not take effect before the next
    one anyway. ``ValueError`` on entry as :func:`cpu_isa`."""
    level = cpu_isa()
    token = _PINNED.set(level)
    try:
        yield level
    finally:
        _PINNED.reset(token)


def lowered() -> bool:
    """Whether :data:`ENV` lowered the level below this CPU's own."""
    return cpu_isa() != detected()


def effective_flags() -> frozenset[str]:
    """:func:`cpu_flags` without those above :func:`cpu_isa` (all of them when not lowered)."""
    level = cpu_isa()
    if level == detected():
        return cpu_flags()
    keep = frozenset().union(*(REQUIRES[lv] for lv in LEVELS[: LEVELS.index(level) + 1]))
    above = _ABOVE_GENERIC if level == "generic" else _ABOVE_AVX2
    return frozenset(f for f in cpu_flags() if f in keep or not f.startswith(above))
