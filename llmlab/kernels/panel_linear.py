"""An fp32 linear layer for decode steps on AVX-512: the engine's small-batch fp32 GEMM on CPU.

A decode step multiplies a few dozen rows (one per running sequence) by every weight of the
model, and in fp32 those weights (four bytes each) do not stay in cache from one step to the
next: each product streams its weight from memory while it computes. oneDNN's prepacked product
(:mod:`~llmlab.kernels.cpu_linear`) waits on that stream: on this repository's machine it reaches
about 105-130 GFLOP/s at 40 rows from cold weights against about 165 with the weight in cache.
``csrc/panel_linear_cpu.cpp`` packs each weight once in panels of 32 output columns, multiplies a
panel by all rows in register blocks of up to 12 rows, and prefetches the next panel into L2
while it does, spread over the row blocks, so the weight arrives while the FMA units work
(docs/kernels.md has the measurements). Accumulation is fp32, over the inputs in order, so
results differ from oneDNN's by the rounding of a different summation order only.

Which products: the packed linear sends fp32 products of 1 to :data:`MAX_ROWS` rows here (decode
steps, small prefills; larger batches stay on oneDNN; :func:`linear` itself takes any number of
rows), any shape, bias or not, on a CPU whose effective flags (:func:`~llmlab.kernels.cpu_isa.effective_flags`,
lowered by ``LLMLAB_CPU_ISA``) have ``avx512f``; :func:`~llmlab.kernels.cpu_linear.pack` then
keeps this packed copy beside oneDNN's (the weight is held three times). Built on first use like
the other C++ kernels (:mod:`~llmlab.kernels.cpu_build`).

Source: Goto and van de Geijn, "Anatomy of High-Performance Matrix Multiplication", ACM TOMS
34(3), 2008, sec. 4-6 (panels of the streamed operand, register blocks).
"""

from __future__ import annotations

import functools
import warnings

import torch

from llmlab.kernels import cpu_isa
from llmlab.kernels.cpu_build import compiled_isa, load

MAX_ROWS = 64  # decode-sized batches (more: oneDNN, as fast once the weight is reused enough)


def _module():
    return load("panel_linear_cpu", "fp32 panel linear kernel (or enable(packed_linear=False))")


def isa() -> str:
    """The vector code the build for the current level uses (:func:`~llmlab.kernels.cpu_build.compiled_isa`)."""
    return compiled_isa("panel_linear_cpu", "fp32 panel linear kernel")


def available() -> bool:
    """Whether this CPU, at the current level, runs the kernel: ``avx512f`` in
    :func:`~llmlab.kernels.cpu_isa.effective_flags` and a build that has it. The packed linear
    takes this path on its own, so a build that fails here warns once and leaves the products on
    oneDNN."""
    if "avx512f" not in cpu_isa.effective_flags():
        return False
    from llmlab.kernels import cpu_build

    return cpu_build.available() and _built(cpu_isa.cpu_isa())


@functools.cache
def _built(level: str) -> bool:
    try:
        return bool(_module().has_avx512())
    except RuntimeError as e:  # the compiler's error: reported, not fatal to the packed linear
        warnings.warn(
            f"the fp32 panel linear kernel did not build ({e}); fp32 products stay on oneDNN",
            stacklevel=3,
        )
        return False


def fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is one the kernel takes: a non-empty 2-D fp32 CPU tensor."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.numel() > 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (fp32; :func:`fits`) in panels ``[ceil(out/32), in, 32]``, zero
    beyond ``out`` (``RuntimeError`` naming the constraint otherwise)."""
    return _module().pack(weight.detach())


def linear(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x [..., in]`` (fp32) times the :func:`pack` ed weight (+ ``bias [out]``) ->
    ``[..., out_features]`` fp32; ``None`` where the build for the current level has no AVX-512
    (``LLMLAB_CPU_ISA`` lowered after packing: the caller takes its other path).
    ``out_features`` must be the packed weight's ``out`` (the panels keep it only to within their
    32-column padding: a larger count within it returns the padding's zero columns).
    ``RuntimeError`` for another dtype, ``in`` or bias than the weight's, or ``out_features``
    outside its panels."""
    m = _module()
    if not m.has_avx512():
        return None
    y = m.linear(x.reshape(-1, x.shape[-1]), panels, out_features, bias)
    return y.view(*x.shape[:-1], out_features)
