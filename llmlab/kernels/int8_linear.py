"""W8A8 linear: int8 weights (per output channel) times int8 activations (per token), int32 sums.

The "dynamic range adjustment" of int8 inference (Xiao et al. 2023 "SmoothQuant" §2 call it
per-token dynamic quantisation; LLM.int8(), Dettmers et al. 2022 §3, vector-wise): each weight
row ``W[o, :]`` is stored as int8 ``qw[o, :]`` with scale ``sw[o] = max|W[o, :]| / 127`` once, at
load time; each activation row (token) ``x[t, :]`` is quantised at run time from its own measured
range, ``sx[t] = max|x[t, :]| / 127``, ``qx = round(x / sx)`` clipped to [-127, 127] (symmetric,
no zero point). The product ``qx @ qw.T`` runs in int8 with int32 accumulation and is
dequantised once per output element: ``y[t, o] = acc[t, o] * sx[t] * sw[o] (+ bias[o])``.

Kernels (:func:`path`), best first:

* ``"onednn"``: oneDNN's int8 matrix product through PyTorch's ``onednn.qlinear_pointwise`` (the
  op Inductor's x86 int8 path emits) on a weight reordered once, at load time, into oneDNN's
  blocked layout (:func:`pack`; AMX-INT8 / AVX-512 VNNI tiles where the CPU has them), with the
  weight scales ``sw[o]`` applied in its epilogue: ``acc * sw[o]`` comes out in fp32 and one
  multiply by ``sx[t]`` finishes it. ``torch._int_mm`` instead hands oneDNN the row-major weight on
  every call.
* ``"int_mm"``: ``torch._int_mm`` (int8 x int8 -> int32), then the dequantisation in PyTorch.
* ``"reference"``: the same integers multiplied in fp32 (``qx.float() @ qw.float().T``); exact
  while a sum stays under 2**24 in magnitude (products are at most 127*127, so up to ~1040 terms
  of the largest size), otherwise rounded like any fp32 sum: agrees with the others to fp32
  rounding (all three dequantise in one order, ``(acc * sw[o]) * sx[t]``, so with exact sums they
  agree bit for bit). Chosen where neither int8 product exists or passes a trial over the whole
  int8 range (oneDNN's AVX2 code saturates, see :func:`_exact`), at ``LLMLAB_CPU_ISA=generic``
  (:mod:`~llmlab.kernels.cpu_isa`), or when ``LLMLAB_INT8_LINEAR=reference`` forces it.

The int8 paths quantise the activations with the one-pass C++ operator of
:mod:`~llmlab.kernels.cpu_fused` where it can be built (:func:`quantize_rows`; the same integers
and scales as :func:`quantize_per_token`, which the reference path uses).
"""

from __future__ import annotations

import functools
import os

import torch

from llmlab.kernels import cpu_build, cpu_fused, cpu_isa

ENV = "LLMLAB_INT8_LINEAR"
PATHS = ("onednn", "int_mm", "reference")
BATCH_HINT = 64  # rows oneDNN picks its blocking for (decode-sized; any row count works)
QMAX = 127


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` float -> ``(qw int8 [out, in], sw fp32 [out])`` with ``w ~= qw * sw[:, None]``
    (symmetric; an all-zero row gets a tiny scale and zeros)."""
    w = w.detach().float()
    sw = w.abs().amax(dim=1).clamp(min=1e-12) / QMAX
    qw = torch.round(w / sw[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return qw, sw


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, in]`` float -> ``(qx int8 [N, in], sx fp32 [N, 1])`` with ``x ~= qx * sx``: each row
    from its own absolute maximum, measured now (dynamic quantisation)."""
    x = x.float()
    sx = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / QMAX
    qx = torch.round(x / sx).clamp_(-QMAX, QMAX).to(torch.int8)
    return qx, sx


def _trial() -> tuple[torch.Tensor, torch.Tensor]:
    """int8 operands spanning the whole range (rows and columns of +-127 included)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-QMAX, QMAX + 1, (32, 256), dtype=torch.int8, generator=g)
    b = torch.randint(-QMAX, QMAX + 1, (64, 256), dtype=torch.int8, generator=g)
    a[0], b[0], a[1] = QMAX, QMAX, -QMAX
    return a, b


@functools.cache
def _exact(kernel: str) -> bool:
    """Whether ``kernel`` exists here and gives the exact product on :func:`_trial`. On an AVX2
    CPU without VNNI oneDNN's s8s8 product sums pairs in saturating int16 (``vpmaddubsw``), which
    a small-valued trial would not see: there both int8 products are wrong and the reference
    path is taken (``ONEDNN_MAX_CPU_ISA=AVX2`` shows it on any x86 machine)."""
    a, b = _trial()
    try:
        if kernel == "onednn":
            ones = torch.ones(b.shape[0])
            return bool(torch.equal(_qlinear(a, pack(b), ones), (a.int() @ b.int().t()).float()))
        return bool(torch.equal(torch._int_mm(a, b.t()), a.int() @ b.int().t()))
    except (RuntimeError, AttributeError):
        return False


def path() -> str:
    """The int8 product :func:`w8a8_linear` runs: ``LLMLAB_INT8_LINEAR`` (one of :data:`PATHS`,
    ``ValueError`` otherwise) if set; else, where the CPU level
    (:func:`~llmlab.kernels.cpu_isa.cpu_isa`) is above ``generic``, the first of ``"onednn"``,
    ``"int_mm"`` that is exact here (:func:`_exact`); else ``"reference"``."""
    forced = os.environ.get(ENV)
    if forced:
        if forced not in PATHS:
            raise ValueError(f"{ENV}={forced!r}: supported values are " + ", ".join(PATHS))
        return forced
    if cpu_isa.cpu_isa() != "generic":
        for kernel in ("onednn", "int_mm"):
            if _exact(kernel):
                return kernel
    return "reference"


def pack(qw: torch.Tensor) -> torch.Tensor:
    """``qw int8 [out, in]`` reordered once into oneDNN's blocked int8 layout (the ``"onednn"``
    path's weight; ``RuntimeError`` where PyTorch's oneDNN cannot)."""
    return torch.ops.onednn.qlinear_prepack(qw, [BATCH_HINT, qw.shape[1]])


def _qlinear(qx: torch.Tensor, packed: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """oneDNN's int8 product of ``qx int8 [N, in]`` and a :func:`pack`-ed weight, ``acc * sw[o]``
    in fp32 ``[N, out]`` (no activation scale or zero point: 1 and 0)."""
    return torch.ops.onednn.qlinear_pointwise(
        qx, 1.0, 0, packed, sw, _zeros(sw.shape[0]), None, 1.0, 0, torch.float32, "none", [], ""
    )


@functools.lru_cache(maxsize=64)
def _zeros(n: int) -> torch.Tensor:
    """The weights' zero points (symmetric: all 0), one tensor per output size, made once."""
    return torch.zeros(n, dtype=torch.int64)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_per_token` of ``x [N, in]``, in one C++ pass
    (:func:`llmlab.kernels.cpu_fused.quantize_per_token`, the same results) where the C++
    operators can be built for a CPU tensor, else the PyTorch reference."""
    if x.device.type == "cpu" and _buildable():
        return cpu_fused.quantize_per_token(x)
    return quantize_per_token(x)


@functools.cache
def _buildable() -> bool:
    """:func:`llmlab.kernels.cpu_build.available`, asked once (it searches ``PATH``: about half a
    millisecond, too dear for every linear of a decode step)."""
    return cpu_build.available()


def int8_matmul(qx: torch.Tensor, qw: torch.Tensor, kernel: str) -> torch.Tensor:
    """``qx int8 [N, in] @ qw int8 [out, in].T`` -> the sums ``[N, out]``: int32 from ``"int_mm"``
    and ``"onednn"`` (its fp32 output with unit scales, exact below 2**24), fp32 (the same
    integers, see the module note) from ``"reference"``."""
    if kernel == "int_mm":
        return torch._int_mm(qx, qw.t())
    if kernel == "onednn":
        return _qlinear(qx, pack(qw), torch.ones(qw.shape[0])).to(torch.int32)
    return qx.float() @ qw.float().t()


def w8a8_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: str | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., in]`` (fp32/bf16/fp16) -> ``[..., out]`` in ``x.dtype``: ``x`` quantised per token
    (:func:`quantize_per_token`), multiplied by ``qw int8 [out, in]`` in int8 (``kernel``, default
    :func:`path`), dequantised once by ``sw[o] * sx[t]``, plus ``bias [out]``. ``packed``: ``qw``
    as :func:`pack` made it (``"onednn"``; packed now if not given)."""
    shape = x.shape
    kernel = kernel or path()
    x2 = x.reshape(-1, shape[-1])
    if kernel == "reference":
        qx, sx = quantize_per_token(x2)
        y = int8_matmul(qx, qw, kernel).mul_(sw).mul_(sx)
    elif kernel == "onednn":
        qx, sx = quantize_rows(x2)
        y = _qlinear(qx, pack(qw) if packed is None else packed, sw).mul_(sx)
    else:
        qx, sx = quantize_rows(x2)
        y = int8_matmul(qx, qw, kernel).float().mul_(sw).mul_(sx)
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype).reshape(*shape[:-1], qw.shape[0])


def reference_linear(
    x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The float reference of the same quantised maths, step by step in fp64 (tests):
    ``(qx * sx) @ (qw * sw[:, None]).T + bias``."""
    qx, sx = quantize_per_token(x.reshape(-1, x.shape[-1]))
    y = (qx.double() * sx.double()) @ (qw.double() * sw.double()[:, None]).t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*x.shape[:-1], qw.shape[0])
