"""An fp32 or bf16 linear layer in panels of 32 outputs (AVX2 or AVX-512): the engine's decode GEMM on CPU.

A decode step multiplies a few dozen rows (one per running sequence) by every weight of the
model, and in fp32 those weights (four bytes each) do not stay in cache from one step to the
next: each product streams its weight from memory while it computes. oneDNN's prepacked product
(:mod:`~llmlab.kernels.cpu_linear`) waits on that stream: on this repository's Intel machine it
reaches about 105-130 GFLOP/s at 40 rows from cold weights against about 165 with the weight in
cache. ``csrc/panel_linear_cpu.cpp`` packs each weight once in panels of 32 output columns,
multiplies a panel by all rows in register blocks of up to 12 rows, and prefetches the next
panel into L2 while it does, spread over the row blocks, so the weight arrives while the FMA
units work (docs/kernels.md has the measurements). Accumulation is fp32, over the inputs in
order, so results differ from oneDNN's by the rounding of a different summation order only. The
AVX2 build (16 vector registers of 8 floats) takes each panel as two halves of 16 columns in
register blocks of up to 6 rows, with the same sums in the same order: its outputs equal the
AVX-512 build's bit for bit.

bf16 weights take the same panels with their inputs interleaved in pairs, multiplied by
AVX512-BF16's ``vdpbf16ps`` (two products added to each fp32 lane), the result rounded once to
bf16 as oneDNN's, in register blocks of up to 8 rows: on a CPU with AVX512-BF16 and no AMX (AMD
Zen 4, say), where the AMX kernel (:mod:`~llmlab.kernels.amx_linear`) cannot run, 1.1-1.7x
oneDNN at 1-64 rows and 1.0-1.1x at prefill sizes (docs/kernels.md).

The bf16 gate/up product of a SwiGLU MLP can end in SwiGLU itself (:func:`pack_swiglu`,
:func:`swiglu`): its panels put 16 gate outputs beside the same 16 up outputs, and
``silu(gate) * up`` is taken from the register block, rounded at the steps the product and
:func:`~llmlab.kernels.cpu_fused.silu_mul` round it apart (equal bit for bit).

Which products: the packed linear sends fp32 products of 1 to :data:`MAX_ROWS` rows here
(decode steps, small prefills; larger batches stay on oneDNN) and bf16 products of any size
(:func:`max_rows`); :func:`linear` itself takes any number of rows, any shape, bias or not:
fp32 on a CPU whose effective flags
(:func:`~llmlab.kernels.cpu_isa.effective_flags`, lowered by ``LLMLAB_CPU_ISA``) have
``avx2`` and ``fma`` (also a bf16 or fp16 weight that :mod:`~llmlab.kernels.cpu_linear` widens
to fp32 where oneDNN cannot pack it), bf16 where they have ``avx512_bf16`` and the AMX tiles do
not take the weight;
:func:`~llmlab.kernels.cpu_linear.pack` then keeps this packed copy beside oneDNN's (the weight
is held three times). Built on first use like the other C++ kernels
(:mod:`~llmlab.kernels.cpu_build`).

Source: Goto and van de Geijn, "Anatomy of High-Performance Matrix Multiplication", ACM TOMS
34(3), 2008, sec. 4-6 (panels of the streamed operand, register blocks); Intel, "Intel
Architecture Instruction Set Extensions Programming Reference" (AVX512_BF16, ``VDPBF16PS``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from llmlab.kernels import cpu_isa
from llmlab.kernels.cpu_build import compiled_isa, load

MAX_ROWS = 64  # fp32: decode-sized batches (more: oneDNN, as fast once the weight is reused enough)


def max_rows(dtype: torch.dtype) -> float:
    """The most rows of a ``dtype`` product the packed linear sends here: :data:`MAX_ROWS` for
    fp32; any number for bf16 (on the CPUs it runs on, as fast as oneDNN's prepacked product or
    faster at every size measured: docs/kernels.md)."""
    return MAX_ROWS if dtype == torch.float32 else float("inf")


def _module():
    return load("panel_linear_cpu", "panel linear kernel (or enable(packed_linear=False))")


def isa() -> str:
    """The vector code the build for the current level uses (:func:`~llmlab.kernels.cpu_build.compiled_isa`)."""
    return compiled_isa("panel_linear_cpu", "panel linear kernel")


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this CPU, at the current level, runs the kernel for ``dtype``: fp32 needs ``avx2``
    and ``fma`` in :func:`~llmlab.kernels.cpu_isa.effective_flags` (the AVX2 build; the AVX-512
    one where the level has it), bf16 ``avx512_bf16``, and a build that has it. The packed linear
    takes this path on its own, so a build that fails here warns once and leaves the products on
    oneDNN."""
    need = {torch.float32: {"avx2", "fma"}, torch.bfloat16: {"avx512_bf16"}}.get(dtype)
    if need is None or not need <= cpu_isa.effective_flags():
        return False
    from llmlab.kernels import cpu_build

    m = _built(cpu_isa.cpu_isa()) if cpu_build.available() else None
    return m is not None and bool(m.has_fp32() if dtype == torch.float32 else m.has_bf16())


@functools.cache
def _built(level: str) -> Any:
    """The build for ``level``, or ``None`` where it failed (one try and one warning a level)."""
    try:
        return _module()
    except RuntimeError as e:  # the compiler's error: reported, not fatal to the packed linear
        warnings.warn(
            f"the panel linear kernel did not build ({e}); fp32 and bf16 products stay on oneDNN",
            stacklevel=3,
        )
        return None


def fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is one the kernel takes: a non-empty 2-D fp32 or bf16 CPU tensor."""
    return (
        weight.dtype in (torch.float32, torch.bfloat16)
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.numel() > 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (fp32 or bf16; :func:`fits`) in panels ``[ceil(out/32), in, 32]``,
    zero beyond ``out`` (bf16: the inputs interleaved in pairs, the layout ``vdpbf16ps`` reads);
    ``RuntimeError`` naming the constraint otherwise."""
    return _module().pack(weight.detach())


def linear(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x [..., in]`` (the packed weight's dtype) times the :func:`pack` ed weight (+ ``bias
    [out]``) -> ``[..., out_features]`` in that dtype; ``None`` where the build for the current
    level lacks the kernel for it (``LLMLAB_CPU_ISA`` lowered after packing: the caller takes its
    other path). ``out_features`` must be the packed weight's ``out`` (the panels keep it only to
    within their 32-column padding: a larger count within it returns the padding's zero columns).
    ``RuntimeError`` for another dtype, ``in`` or bias than the weight's, or ``out_features``
    outside its panels."""
    fn = _kernel(cpu_isa.cpu_isa(), panels.dtype)
    if fn is None:
        return None
    y = fn(x.reshape(-1, x.shape[-1]), panels, out_features, bias)
    return y.view(*x.shape[:-1], out_features)


def runs(dtype: torch.dtype) -> bool:
    """Whether :func:`linear` (and, for bf16, :func:`swiglu`) runs the kernel for ``dtype`` at the
    current level, rather than returning ``None``."""
    return _kernel(cpu_isa.cpu_isa(), dtype) is not None


@functools.cache
def _kernel(level: str, dtype: torch.dtype):
    """The build's ``linear`` where it has the kernel for ``dtype`` at ``level``, else ``None``
    (looked up once: :func:`linear` runs for every product of a decode step)."""
    m = _module()
    return m.linear if (m.has_fp32() if dtype == torch.float32 else m.has_bf16()) else None


def pack_swiglu(weight: torch.Tensor, intermediate: int) -> torch.Tensor:
    """A fused gate/up weight ``[2 * intermediate, in]`` (bf16: gate rows, then up rows) in
    panels of 16 gate outputs beside the same 16 up outputs, ``[ceil(intermediate/16), in, 32]``
    (zero past ``intermediate``), for :func:`swiglu`. ``ValueError`` for another shape."""
    if weight.dim() != 2 or weight.shape[0] != 2 * intermediate or intermediate < 1:
        raise ValueError(
            f"pack_swiglu: the gate/up weight must be [2 * {intermediate}, in], got {list(weight.shape)}"
        )
    k, groups = weight.shape[1], -(-intermediate // 16)
    halves = torch.zeros(2, groups * 16, k, dtype=weight.dtype)
    halves[:, :intermediate] = weight.detach().view(2, intermediate, k)
    return pack(halves.view(2, groups, 16, k).transpose(0, 1).reshape(groups * 32, k))


def swiglu(x: torch.Tensor, panels: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """``silu(x gate^T) * (x up^T)`` -> ``[..., intermediate]`` bf16 from :func:`pack_swiglu`'s
    panels, in one pass: SwiGLU is the product's epilogue, rounded step by step to bf16 as the
    product and :func:`~llmlab.kernels.cpu_fused.silu_mul` round it when apart (so the two
    agree to bf16 rounding of the fp32 sums' order), and the ``[rows, 2 * intermediate]``
    product is never written. ``None`` where the build for the current level lacks the bf16
    kernel. ``RuntimeError`` for another dtype or ``in``."""
    if _kernel(cpu_isa.cpu_isa(), torch.bfloat16) is None:
        return None
    y = _module().linear_swiglu(x.reshape(-1, x.shape[-1]), panels, intermediate)
    return y.view(*x.shape[:-1], intermediate)
