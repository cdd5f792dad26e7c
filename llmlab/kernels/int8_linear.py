"""W8A8 linear: int8 weights (per output channel) times int8 activations (per token), int32 sums.

The "dynamic range adjustment" of int8 inference (Xiao et al. 2023 "SmoothQuant" §2 call it
per-token dynamic quantisation; LLM.int8(), Dettmers et al. 2022 §3, vector-wise): each weight
row ``W[o, :]`` is stored as int8 ``qw[o, :]`` with scale ``sw[o] = max|W[o, :]| / 127`` once, at
load time; each activation row (token) ``x[t, :]`` is quantised at run time from its own measured
range, ``sx[t] = max|x[t, :]| / 127``, ``qx = round(x / sx)`` clipped to [-127, 127] (symmetric,
no zero point). The product ``qx @ qw.T`` runs in int8 with int32 accumulation and is
dequantised once per output element: ``y[t, o] = acc[t, o] * sx[t] * sw[o] (+ bias[o])``.

Kernels (:func:`path`):

* ``"int_mm"``: ``torch._int_mm`` (int8 x int8 -> int32), which PyTorch's CPU build runs through
  oneDNN's int8 GEMM (AVX-512 VNNI / AMX-INT8 where the CPU has them, AVX2 ``vpmaddubsw`` code
  otherwise); any shapes.
* ``"reference"``: the same integers multiplied in fp32 (``qx.float() @ qw.float().T``); exact
  while a sum stays under 2**24 in magnitude (products are at most 127*127, so up to ~1040 terms
  of the largest size), otherwise rounded like any fp32 sum: agrees with ``"int_mm"`` to fp32
  rounding. Chosen where ``torch._int_mm`` is missing or fails a trial, at ``LLMLAB_CPU_ISA=generic``
  (:mod:`~llmlab.kernels.cpu_isa`), or when ``LLMLAB_INT8_LINEAR=reference`` forces it.
"""

from __future__ import annotations

import functools
import os

import torch

from llmlab.kernels import cpu_isa

ENV = "LLMLAB_INT8_LINEAR"
PATHS = ("int_mm", "reference")
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


@functools.cache
def _int_mm_works() -> bool:
    """Whether ``torch._int_mm`` exists here and gives the exact int32 product on a trial over the
    whole int8 range. On an AVX2 CPU without VNNI oneDNN's s8s8 product sums pairs in saturating
    int16 (``vpmaddubsw``), which a small-valued trial would not see: there it is wrong and the
    reference path is taken (``ONEDNN_MAX_CPU_ISA=AVX2`` shows it on any x86 machine)."""
    if not hasattr(torch, "_int_mm"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-QMAX, QMAX + 1, (32, 256), dtype=torch.int8, generator=g)
        b = torch.randint(-QMAX, QMAX + 1, (256, 64), dtype=torch.int8, generator=g)
        a[0], b[:, 0], a[1] = QMAX, QMAX, -QMAX
        return bool(torch.equal(torch._int_mm(a, b), a.int() @ b.int()))
    except RuntimeError:
        return False


def path() -> str:
    """The int8 product :func:`w8a8_linear` runs: ``LLMLAB_INT8_LINEAR`` (one of :data:`PATHS`,
    ``ValueError`` otherwise) if set; else ``"int_mm"`` where it works and the CPU level
    (:func:`~llmlab.kernels.cpu_isa.cpu_isa`) is above ``generic``; else ``"reference"``."""
    forced = os.environ.get(ENV)
    if forced:
        if forced not in PATHS:
            raise ValueError(f"{ENV}={forced!r}: supported values are " + ", ".join(PATHS))
        return forced
    if cpu_isa.cpu_isa() == "generic" or not _int_mm_works():
        return "reference"
    return "int_mm"


def int8_matmul(qx: torch.Tensor, qw: torch.Tensor, kernel: str) -> torch.Tensor:
    """``qx int8 [N, in] @ qw int8 [out, in].T`` -> the sums ``[N, out]``: int32 from ``"int_mm"``,
    fp32 (the same integers, see the module note) from ``"reference"``."""
    if kernel == "int_mm":
        return torch._int_mm(qx, qw.t())
    return qx.float() @ qw.float().t()


def w8a8_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """``x [..., in]`` (fp32/bf16/fp16) -> ``[..., out]`` in ``x.dtype``: ``x`` quantised per token
    (:func:`quantize_per_token`), multiplied by ``qw int8 [out, in]`` in int8 (``kernel``, default
    :func:`path`), dequantised once by ``sx[t] * sw[o]``, plus ``bias [out]``."""
    shape = x.shape
    qx, sx = quantize_per_token(x.reshape(-1, shape[-1]))
    acc = int8_matmul(qx, qw, kernel or path())
    y = acc.float().mul_(sx).mul_(sw)
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
