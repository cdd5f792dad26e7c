"""Fused elementwise operators for CPU tensors, in C++: the inference engine's RMSNorm (with the
residual add before it), SiLU-and-multiply and rotary embedding on CPU, the step's greedy
argmax (:func:`argmax_rows`) and its bf16-screened form for fp32 logits (:func:`screened_argmax`), the paged KV cache write (:func:`write_kv`), and W8A8's per-token activation quantisation
(:func:`quantize_per_token`, which :mod:`~llmlab.kernels.int8_linear` calls on its int8 paths
whether or not ``cpu_fused`` is on).

In a decoder layer these are a dozen PyTorch operators (RMSNorm alone is a cast, a square, a
mean, a reciprocal square root, two products and a cast back), each of which reads and writes
its whole tensor: for a prompt step of a few thousand tokens on a CPU they cost about as much as
the attention. ``csrc/fused_ops_cpu.cpp`` does each in one pass over the rows, with the same
arithmetic and the same roundings as the PyTorch reference (fp32 inside; the result rounded to
the storage dtype where the reference's operator rounds it), as vLLM's CPU backend fuses them in
its own C++ operators. ``tests/test_cpu_fused.py`` checks each against the reference.

Select them with ``llmlab.kernels.enable(cpu_fused=True)`` or ``LLMLAB_KERNELS=cpu_fused``: the
model's :class:`~llmlab.model.layers.RMSNorm`, :class:`~llmlab.model.layers.MLP` and the serving
path of :class:`~llmlab.model.llama.Attention` then call them for CPU tensors. Built on first use
like the other CPU kernels (:mod:`llmlab.kernels.cpu_build`: a C++ compiler and ``ninja``).
"""

from __future__ import annotations

import torch

from llmlab.kernels.cpu_build import compiled_isa, load


def _module():
    return load("fused_ops_cpu", "fused CPU operators (or enable(cpu_fused=False))")


def isa() -> str:
    """The vector code the build for the current level uses (:func:`~llmlab.kernels.cpu_build.compiled_isa`:
    ``"avx512_bf16"``, ``"avx512"``, ``"avx2"`` or ``"generic"``); builds it if needed."""
    return compiled_isa("fused_ops_cpu", "fused CPU operators")


def build() -> None:
    """Compile (or load the cached build of) the operators now (``RuntimeError`` where they
    cannot be built, see :func:`llmlab.kernels.cpu_build.available`)."""
    _module()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of ``x [..., h]`` with ``weight [h]`` (Zhang & Sennrich 2019), as
    :class:`llmlab.model.layers.RMSNorm` computes it; returns ``[..., h]`` in x's dtype. With
    ``residual [..., h]``: normalises ``x + residual`` instead and returns ``(normed, x +
    residual)`` (the sum rounded to the dtype, as ``x + residual`` would be). CPU tensors of one
    dtype (fp32, bf16, fp16); ``RuntimeError`` naming the constraint otherwise."""
    out = _module().rms_norm(x, weight, float(eps), residual)
    return out[0] if residual is None else (out[0], out[1])


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU, Shazeer 2020) of ``gate, up [..., I]``, which may be the
    two halves of the fused gate/up projection's output (views with strided rows, read in
    place) -> ``[..., I]``."""
    I = gate.shape[-1]
    out = _module().silu_mul(gate.reshape(-1, I), up.reshape(-1, up.shape[-1]))
    return out.view(gate.shape)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place (RoPE, Su et al. 2021, the rotate-half form of
    :func:`llmlab.model.llama.apply_rotary`): ``x [N, heads, D]`` (rows may be strided, D
    contiguous) by ``cos, sin [N, D]`` of x's dtype; returns ``x``."""
    _module().rotary_(x, cos, sin)
    return x


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's per-token activation quantisation in one pass: ``x [..., h]`` (fp32, bf16, fp16;
    CPU) -> ``(qx int8 [N, h], sx fp32 [N, 1])`` with ``N`` the rows of ``x``; the same results,
    bit for bit, as :func:`llmlab.kernels.int8_linear.quantize_per_token` (``sx = max(max|x|,
    1e-12) / 127`` per row, ``qx = round(x / sx)``, half to even, clipped to [-127, 127])."""
    q, s = _module().quantize_per_token(x)
    return q, s


def argmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's greedy tokens in one pass: ``x [rows, V]`` (fp32, bf16, fp16; CPU, ``V``
    contiguous) -> ``(index int64 [rows], finite bool [rows])``, ``index`` the first maximum of
    each row (``torch.argmax``'s choice) where the row is finite (no nan, no inf), 0 where not."""
    idx, finite = _module().argmax_rows(x)
    return idx, finite


def screened_argmax(
    h: torch.Tensor, approx: torch.Tensor, w: torch.Tensor, wnorm: torch.Tensor, c: float, u: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first maximum of each row of the fp32 logits ``h @ w.T`` from bf16 approximations
    (:mod:`llmlab.inference.greedy_screen`): ``h [rows, K]`` fp32, ``approx [rows, V]`` bf16,
    ``w [V, K]`` fp32, ``wnorm [V]`` (each at least ``|w_v|``), ``approx`` within ``c |h| wnorm_v
    + u |approx_v|`` of the fp32 logits (plus a denormal term). Only the tokens whose interval
    reaches the highest lower end are recomputed in fp32. -> ``(index int64 [rows], ok bool
    [rows])``; ``ok`` false (index 0) where ``h``, ``approx`` or a recomputed logit is not finite
    or ``|h| max(wnorm)`` could overflow. ``RuntimeError`` naming the constraint for other shapes
    or dtypes."""
    idx, ok = _module().screened_argmax(h, approx, w, wnorm, c, u)
    return idx, ok


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """The paged KV cache write of :func:`llmlab.inference.paged_attention.write_kv` in one
    call: ``k, v [N, Hkv, D]`` (each row contiguous; rows may be strided) stored at flat ``slots
    [N]`` (int64) of ``k_cache, v_cache [num_blocks, block_size, Hkv, D]`` (contiguous, k's
    dtype), in place. ``RuntimeError`` naming the constraint for other shapes or dtypes, or a
    slot outside the cache."""
    _module().write_kv(k_cache, v_cache, k, v, slots)
