"""Building the C++ CPU kernels (``llmlab/kernels/csrc/*.cpp``) on first use.

Each kernel module (:mod:`~llmlab.kernels.cpu_paged_attention`, :mod:`~llmlab.kernels.cpu_fused`)
is one C++ file compiled by PyTorch's extension builder (:func:`torch.utils.cpp_extension.load`),
which needs a C++ compiler and the ``ninja`` package (``pip install "llmlab[cpu-kernels]"``). A
build takes about a minute and is cached under ``~/.cache/torch_extensions``, keyed by the
source and the shared headers, the flags and this CPU (the flags target the machine they are built on).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
# Reassociating float sums (and only that: no finite-math or reciprocal shortcuts) lets the dot
# products and the softmax sum reduce as a tree of vector adds instead of one lane at a time.
FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math"] + (["-march=native", "-mprefer-vector-width=512"]
                                  if platform.machine() in ("x86_64", "AMD64") else [])


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


@functools.cache
def load(stem: str, what: str):
    """The compiled module of ``csrc/<stem>.cpp`` (built now, or loaded from the cache).
    ``what`` names the kernel in the error raised where :func:`available` is False
    (``RuntimeError``); a failing build raises the compiler's error."""
    if not available():
        raise RuntimeError(f"the {what} needs a C++ compiler and the ninja package (pip install ninja)")
    from torch.utils.cpp_extension import load as build
    source = CSRC / f"{stem}.cpp"
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))   # (included by the sources)
    tag = hashlib.sha1(source.read_bytes() + headers + " ".join(FLAGS).encode() + _cpu_id()).hexdigest()[:10]
    return build(name=f"llmlab_{stem}_{tag}", sources=[str(source)], extra_cflags=FLAGS, verbose=False)
