"""A bf16 linear layer for decode steps on Intel AMX tiles: the engine's small-batch GEMM on CPU.

A decode step multiplies a few dozen rows (one per running sequence) by every weight of the
model, so on a CPU its linear layers are bound by how fast the weights stream from memory. On a
machine with AMX, oneDNN's prepacked bf16 product (:mod:`~llmlab.kernels.cpu_linear`) reaches
about 7-9 GB/s of weight there at 40 rows; ``csrc/amx_linear_cpu.cpp`` packs each weight once
into the tiles' own layout (one contiguous 1 KB tile per 16 outputs and 32 inputs), loads each
tile once for every row block and prefetches the stream ahead, and reaches 10-13 GB/s
(docs/kernels.md has the table). Accumulation is fp32, the result rounded once to bf16, as
oneDNN's; the sum runs in blocks of 32 inputs in order, so results differ from oneDNN's by the
rounding of a different summation order only.

Which products: bf16, 1 to :data:`MAX_ROWS` rows, no bias, in and out features multiples of
32, on a CPU whose effective flags (:func:`~llmlab.kernels.cpu_isa.effective_flags`, lowered by
``LLMLAB_CPU_ISA``) have ``amx_bf16``; :func:`~llmlab.kernels.cpu_linear.pack` then keeps this
packed copy beside oneDNN's, and :func:`~llmlab.kernels.cpu_linear.linear` takes it for
small batches (prefill-sized ones stay on oneDNN, which is as fast there). Built on first use
like the other C++ kernels (:mod:`~llmlab.kernels.cpu_build`).
"""

from __future__ import annotations

import functools
import warnings

import torch

from llmlab.kernels import cpu_isa
from llmlab.kernels.cpu_build import compiled_isa, load

MAX_ROWS = 48  # three row blocks of 16 tiles' rows (more: oneDNN)


def _module():
    return load("amx_linear_cpu", "AMX linear kernel (or enable(packed_linear=False))")


def isa() -> str:
    """The vector code the build for the current level uses (:func:`~llmlab.kernels.cpu_build.compiled_isa`)."""
    return compiled_isa("amx_linear_cpu", "AMX linear kernel")


def available() -> bool:
    """Whether this CPU, at the current level, runs the kernel: ``amx_bf16``, ``amx_tile`` and
    ``avx512_bf16`` in :func:`~llmlab.kernels.cpu_isa.effective_flags` and a build that has them.
    The packed linear takes this path on its own (no switch of its own), so a build that fails
    here (an assembler without AMX, say) warns once and leaves the products on oneDNN."""
    flags = cpu_isa.effective_flags()
    if not {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags:
        return False
    from llmlab.kernels import cpu_build

    return cpu_build.available() and _built(cpu_isa.cpu_isa())


@functools.cache
def _built(level: str) -> bool:
    try:
        return bool(_module().has_amx())
    except RuntimeError as e:  # the compiler's error: reported, not fatal to the packed linear
        warnings.warn(
            f"the AMX linear kernel did not build ({e}); bf16 products stay on oneDNN", stacklevel=3
        )
        return False


def fits(weight: torch.Tensor) -> bool:
    """Whether ``weight [out, in]`` has a shape and dtype the kernel takes (bf16 CPU, both
    dimensions multiples of 32)."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[0] % 32 == 0
        and weight.shape[1] % 32 == 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (bf16; :func:`fits`) in AMX tile layout ``[out/16, in/32, 16, 16, 2]``
    (``RuntimeError`` naming the constraint for other shapes)."""
    return _module().pack(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """``x [..., in]`` (bf16, 1 to :data:`MAX_ROWS` rows in all) times the :func:`pack` ed
    weight -> ``[..., out]`` bf16; ``None`` where the build for the current level has no AMX
    (``LLMLAB_CPU_ISA`` lowered after packing: the caller takes its other path).
    ``RuntimeError`` for more rows or another dtype."""
    m = _module()
    if not m.has_amx():
        return None
    y = m.linear(x.reshape(-1, x.shape[-1]), packed)
    return y.view(*x.shape[:-1], y.shape[-1])
