"""Building the C++ CPU kernels (``llmlab/kernels/csrc/*.cpp``) on first use.

Each kernel module (:mod:`~llmlab.kernels.cpu_paged_attention`, :mod:`~llmlab.kernels.cpu_fused`)
is one C++ file compiled by PyTorch's extension builder (:func:`torch.utils.cpp_extension.load`),
which needs a C++ compiler and the ``ninja`` package (``pip install "llmlab[cpu-kernels]"``). A
build takes about a minute and is cached under ``~/.cache/torch_extensions``, keyed by the
source and the shared headers, the flags and this CPU (the flags target the machine they are built on).

The flags follow the CPU's instruction-set level (:func:`llmlab.kernels.cpu_isa.cpu_isa`): at the
level the CPU has, ``-march=native``; lowered with ``LLMLAB_CPU_ISA``, the x86-64 level's own
target (``avx512``: ``x86-64-v4``, ``avx2``: ``x86-64-v3``, ``generic``: ``x86-64``), a separate
build. Each module's ``isa()`` names the vector code it was compiled with
(:func:`compiled_isa`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
from pathlib import Path

from llmlab.kernels import cpu_isa

CSRC = Path(__file__).resolve().parent / "csrc"
# Reassociating float sums (and only that: no finite-math or reciprocal shortcuts) lets the dot
# products and the softmax sum reduce as a tree of vector adds instead of one lane at a time.
FLAGS = [
    "-O3",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
# -march for a level lowered below the CPU's own (x86-64 psABI levels; GCC >= 11, Clang >= 12).
MARCH = {
    "avx512_bf16": "-march=native",
    "avx512": "-march=x86-64-v4",
    "avx2": "-march=x86-64-v3",
    "generic": "-march=x86-64",
}


def flags(isa: str | None = None, native: bool | None = None, x86: bool | None = None) -> list[str]:
    """The compiler flags for level ``isa`` (default: :func:`~llmlab.kernels.cpu_isa.cpu_isa`).
    ``native``: the level is this CPU's own (default: not lowered), so ``-march=native``; else the
    level's :data:`MARCH`. No ``-march`` off x86-64 (``x86``; default: this machine)."""
    isa = cpu_isa.cpu_isa() if isa is None else isa
    native = (isa == cpu_isa.detected()) if native is None else native
    x86 = platform.machine() in ("x86_64", "AMD64") if x86 is None else x86
    if not x86:
        return list(FLAGS)
    wide = ["-mprefer-vector-width=512"] if isa.startswith("avx512") else []
    return FLAGS + ["-march=native" if native else MARCH[isa]] + wide


def available() -> bool:
    """Whether the kernels can be built here: a C++ compiler on ``PATH`` (``$CXX``, ``c++``,
    ``g++`` or ``clang++``) and the ``ninja`` package (the builder needs both)."""
    cxx = os.environ.get("CXX")
    has_cxx = any(shutil.which(c) for c in ([cxx] if cxx else []) + ["c++", "g++", "clang++"])
    return has_cxx and importlib.util.find_spec("ninja") is not None


def _cpu_id() -> bytes:
    """This CPU's model and feature flags (``/proc/cpuinfo`` where there is one): ``-march=native``
    builds for them, so a cache shared by different machines must not mix their builds."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()
    except OSError:
        return (platform.machine() + platform.processor()).encode()


def load(stem: str, what: str):
    """The compiled module of ``csrc/<stem>.cpp`` for the current level (built now, or loaded from
    the cache). ``what`` names the kernel in the error raised where :func:`available` is False
    (``RuntimeError``); a failing build raises the compiler's error. (Called on every kernel
    call: one cache lookup, and an environment read outside :func:`~llmlab.kernels.cpu_isa.pinned`.)"""
    return _load(stem, what, cpu_isa.cpu_isa())


@functools.cache
def _load(stem: str, what: str, isa: str):
    if not available():
        raise RuntimeError(f"the {what} needs a C++ compiler and the ninja package (pip install ninja)")
    from torch.utils.cpp_extension import load as build

    source = CSRC / f"{stem}.cpp"
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # (included by the sources)
    cflags = flags(isa)
    tag = hashlib.sha1(source.read_bytes() + headers + " ".join(cflags).encode() + _cpu_id()).hexdigest()[:10]
    return build(name=f"llmlab_{stem}_{tag}", sources=[str(source)], extra_cflags=cflags, verbose=False)


def compiled_isa(stem: str, what: str) -> str:
    """The vector code ``csrc/<stem>.cpp`` was compiled with at the current level, as its
    ``isa()`` reports it (``"avx512_bf16"``, ``"avx512"``, ``"avx2"`` or ``"generic"``)."""
    return load(stem, what).isa()
