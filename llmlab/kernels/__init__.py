"""Kernels: FlashAttention and fused operators in Triton, and the switch the model reads.

Files (one idea each):

* :mod:`~llmlab.kernels.online_softmax`: the running max / running sum trick, step by step.
* :mod:`~llmlab.kernels.reference`: PyTorch references: attention with the ``[T, T]`` scores
  materialised, FlashAttention's tiled algorithm in PyTorch, RMSNorm, SwiGLU.
* :mod:`~llmlab.kernels.flash_attention`: Triton FlashAttention forward and backward.
* :mod:`~llmlab.kernels.fused_rmsnorm`, :mod:`~llmlab.kernels.fused_swiglu`: fused Triton ops.
* :mod:`~llmlab.kernels.paged_attention`: Triton PagedAttention (decode and prefill over block
  tables) for the inference engine.
* :mod:`~llmlab.kernels.cpu_paged_attention`: PagedAttention in C++ for CPU tensors (the
  engine's fast path on CPU; ``csrc/paged_attention_cpu.cpp``).
* :mod:`~llmlab.kernels.cpu_linear`: linear layers with weights prepacked once for oneDNN (the
  engine's GEMM on CPU, ``packed_linear=True``).
* :mod:`~llmlab.kernels.cpu_fused`: RMSNorm (after the residual add), SiLU-and-multiply and rotary
  embedding fused in C++ for CPU tensors (``cpu_fused=True``; ``csrc/fused_ops_cpu.cpp``).
* :mod:`~llmlab.kernels.cpu_build`: how the C++ CPU kernels are compiled on first use.
* :mod:`~llmlab.kernels.bench`: timing (GPU) and memory-versus-sequence-length measurements.

The model (:mod:`llmlab.model.llama`) uses PyTorch by default: SDPA for attention, eager RMSNorm
and SwiGLU. ``enable`` opts in::

    import llmlab.kernels as K
    K.enable(attention="triton", rmsnorm=True, swiglu=True)   # process-wide
    with K.use(attention="reference"): ...                    # temporarily

``attention`` is one of ``"sdpa"`` (default), ``"eager"`` (scores materialised),
``"reference"`` (tiled flash in PyTorch, any device) or ``"triton"``. Triton kernels run on CUDA
tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before they were first imported
(correctness only: the interpreter is very slow); on other CPU tensors the model keeps PyTorch.
The environment variable ``LLMLAB_KERNELS`` (e.g. ``attention=triton,rmsnorm,swiglu``) sets the
initial state, which reaches ``llmlab train`` and ranks started by :func:`llmlab.launch`
when set before Python starts; otherwise call ``enable`` inside the rank function.

The inference engine's three choices (``paged_attention``, ``packed_linear``, ``cpu_fused``) are
fields of its :class:`~llmlab.inference.engine_config.EngineConfig`: the settings here (and
``LLMLAB_KERNELS``) are only their defaults, read when a config is made, and the engine then
uses its config's (``LLM(model, paged_attention="cpu", packed_linear=True, cpu_fused=True)``).
Every CPU fast path chooses by what the CPU offers (:mod:`~llmlab.kernels.cpu_isa`;
``LLMLAB_CPU_ISA=avx2`` makes it choose as an AVX2-only CPU would).

The inference engine's PagedAttention is the exception: ``paged_attention="auto"`` (default)
uses the Triton kernel on CUDA tensors whenever triton is installed, the PyTorch reference
otherwise; ``"triton"`` also uses it on CPU tensors under the interpreter, ``"reference"``
never; ``"cpu"`` uses the C++ kernel for CPU tensors
(:mod:`~llmlab.kernels.cpu_paged_attention`: it walks the block tables in place instead of
gathering a padded copy; compiled on first use, it needs a C++ compiler and ``ninja``) and Triton
on CUDA ones as ``"auto"`` does. ``cpu_fused=True`` makes the model's RMSNorm (with the residual
add before the second norm of a layer), SwiGLU and the serving path's rotary embedding use the
C++ operators of :mod:`~llmlab.kernels.cpu_fused` on CPU tensors. ``LLMLAB_KERNELS=0`` (or
``off``) switches every kernel off, these included.

Triton is optional: importing this package never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import warnings

import torch
import torch.nn.functional as F

from llmlab.kernels.cpu_linear import gate_up_swiglu, linear  # noqa: F401  (F.linear, or the packed weight's)
from llmlab.kernels.online_softmax import (
    merge_softmax_partials,
    online_softmax,
    online_softmax_matmul,
    online_softmax_steps,
    softmax_partial,
)
from llmlab.kernels.reference import (
    attention_reference,
    flash_attention_reference,
    rms_norm_reference,
    swiglu_reference,
)

ATTENTION_IMPLS = ("sdpa", "eager", "reference", "triton")
PAGED_ATTENTION_IMPLS = ("auto", "triton", "reference", "cpu")
TRITON_PIP = "pip install triton==3.9.0"


@dataclasses.dataclass
class KernelSettings:
    """Which implementation the model uses. ``attention`` in :data:`ATTENTION_IMPLS`;
    ``rmsnorm``/``swiglu``: use the fused Triton kernels where they can run;
    ``paged_attention`` in :data:`PAGED_ATTENTION_IMPLS`: the inference engine's attention
    (``"auto"``: Triton on CUDA tensors when triton is installed; ``"cpu"``: also the C++
    kernel on CPU tensors); ``packed_linear``: the engine's linear layers on a CPU device use
    weights prepacked once for oneDNN (:mod:`~llmlab.kernels.cpu_linear`); ``cpu_fused``: the
    C++ RMSNorm, SwiGLU and rotary operators for CPU tensors (:mod:`~llmlab.kernels.cpu_fused`).
    The last three are the defaults of the engine's ``EngineConfig`` fields of the same names
    (``cpu_fused`` also applies to the model run outside an engine)."""

    attention: str = "sdpa"
    rmsnorm: bool = False
    swiglu: bool = False
    paged_attention: str = "auto"
    packed_linear: bool = False
    cpu_fused: bool = False


_settings = KernelSettings()


# The platforms the ``kernels`` extra installs triton on (pyproject.toml; tests check they agree).
TRITON_MARKER = "python_version >= '3.11' and platform_system == 'Linux' and platform_machine == 'x86_64'"


def triton_platform() -> bool:
    """True where ``pip install llmlab[kernels]`` installs triton (:data:`TRITON_MARKER`): there
    a missing triton is an installation error, elsewhere the Triton kernels cannot exist."""
    import platform
    import sys

    return sys.version_info >= (3, 11) and platform.system() == "Linux" and platform.machine() == "x86_64"


def triton_available() -> bool:
    """True if the ``triton`` package is installed (it is not imported)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """True if Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "no")


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``t``'s device here."""
    if not triton_available():
        return False
    return t.is_cuda or (t.device.type == "cpu" and triton_interpreted())


def settings() -> KernelSettings:
    """A copy of the current settings."""
    return dataclasses.replace(_settings)


def enable(
    attention: str | None = None,
    rmsnorm: bool | None = None,
    swiglu: bool | None = None,
    paged_attention: str | None = None,
    packed_linear: bool | None = None,
    cpu_fused: bool | None = None,
) -> KernelSettings:
    """Choose the kernels the model uses from now on (``None`` leaves a field unchanged).

    Returns the previous settings. Raises ``ValueError`` for an unknown attention or
    paged_attention implementation and ``RuntimeError`` if a Triton kernel is requested without
    triton installed, or a C++ CPU kernel (``paged_attention="cpu"``, ``cpu_fused``) without a
    C++ compiler and ninja.
    """
    global _settings
    new = dataclasses.replace(_settings)
    if attention is not None:
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={attention!r} must be one of {ATTENTION_IMPLS}")
        new.attention = attention
    if rmsnorm is not None:
        new.rmsnorm = bool(rmsnorm)
    if swiglu is not None:
        new.swiglu = bool(swiglu)
    if paged_attention is not None:
        if paged_attention not in PAGED_ATTENTION_IMPLS:
            raise ValueError(f"paged_attention={paged_attention!r} must be one of {PAGED_ATTENTION_IMPLS}")
        if paged_attention == "cpu":
            from llmlab.kernels.cpu_paged_attention import available

            if not available():
                raise RuntimeError(
                    "paged_attention='cpu' needs a C++ compiler and the ninja package (pip install ninja)"
                )
        new.paged_attention = paged_attention
    if packed_linear is not None:
        from llmlab.kernels.cpu_linear import available as packing_available

        if packed_linear and not packing_available():
            raise RuntimeError("packed_linear needs PyTorch built with oneDNN (mkldnn)")
        new.packed_linear = bool(packed_linear)
    if cpu_fused is not None:
        from llmlab.kernels.cpu_build import available

        if cpu_fused and not available():
            raise RuntimeError("cpu_fused needs a C++ compiler and the ninja package (pip install ninja)")
        new.cpu_fused = bool(cpu_fused)
    wants_triton = new.attention == "triton" or new.rmsnorm or new.swiglu or new.paged_attention == "triton"
    if wants_triton and not triton_available():
        raise RuntimeError(f"the Triton kernels need the triton package: {TRITON_PIP}")
    if wants_triton and not torch.cuda.is_available() and not triton_interpreted():
        warnings.warn(
            "Triton kernels enabled but no CUDA device and TRITON_INTERPRET is not set: "
            "CPU tensors keep the PyTorch implementations",
            stacklevel=2,
        )
    old, _settings = _settings, new
    return old


def disable() -> KernelSettings:
    """Back to the defaults (SDPA, eager RMSNorm and SwiGLU, ``paged_attention="auto"``).
    Returns the previous settings."""
    global _settings
    old, _settings = _settings, KernelSettings()
    return old


@contextlib.contextmanager
def use(
    attention: str | None = None,
    rmsnorm: bool | None = None,
    swiglu: bool | None = None,
    paged_attention: str | None = None,
    packed_linear: bool | None = None,
    cpu_fused: bool | None = None,
):
    """Context manager: :func:`enable` on entry, previous settings restored on exit."""
    global _settings
    old = enable(attention, rmsnorm, swiglu, paged_attention, packed_linear, cpu_fused)
    try:
        yield settings()
    finally:
        _settings = old


FUSED_KINDS = ("attention", "rmsnorm", "swiglu", "rotary", "residual_rmsnorm")


def _cpu_fused(t: torch.Tensor, cpu_fused: bool | None = None) -> bool:
    return (_settings.cpu_fused if cpu_fused is None else cpu_fused) and t.is_cpu


def use_fused(kind: str, t: torch.Tensor, cpu_fused: bool | None = None) -> bool:
    """Whether the model should call :func:`attention` / :func:`rms_norm` / :func:`swiglu` /
    :func:`rotary` for tensor ``t`` instead of its default PyTorch code (``kind`` in
    :data:`FUSED_KINDS`; ``"residual_rmsnorm"``: :func:`rms_norm` with the residual add, which
    only the C++ CPU operator fuses; ``ValueError`` for another kind). ``cpu_fused``: the
    engine's choice of the C++ operators (``EngineConfig.cpu_fused``, read by the model from the
    step's forward context); ``None`` outside an engine: the process-wide setting."""
    if kind == "attention":
        if _settings.attention == "sdpa":
            return False
        return _settings.attention != "triton" or triton_runs_on(t)
    if kind in ("rmsnorm", "swiglu"):
        return _cpu_fused(t, cpu_fused) or (getattr(_settings, kind) and triton_runs_on(t))
    if kind in ("rotary", "residual_rmsnorm"):
        return _cpu_fused(t, cpu_fused)
    raise ValueError(f"kind={kind!r} must be one of {FUSED_KINDS}")


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, impl: str | None = None
) -> torch.Tensor:
    """Attention ``q [B,H,T,D]``, ``k, v [B,H_kv,T,D]`` -> ``[B,H,T,D]`` with the implementation
    ``impl`` (default: the current setting). ``"triton"`` needs CUDA tensors or the
    interpreter (``RuntimeError`` otherwise)."""
    impl = impl or _settings.attention
    if impl == "sdpa":
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if impl == "eager":
        return attention_reference(q, k, v, causal)
    if impl == "reference":
        return flash_attention_reference(q, k, v, causal)
    if impl == "triton":
        from llmlab.kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, causal)
    raise ValueError(f"impl={impl!r} must be one of {ATTENTION_IMPLS}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    cpu_fused: bool | None = None,
):
    """RMSNorm of ``x [..., h]``: the C++ operator on CPU tensors when ``cpu_fused`` is on, the
    fused Triton kernel where it can run (:func:`triton_runs_on`), else the PyTorch one. With
    ``residual``: normalises ``x + residual`` and returns ``(normed, x + residual)`` (one pass
    in the C++ operator). ``cpu_fused``: as :func:`use_fused`."""
    if _cpu_fused(x, cpu_fused):
        from llmlab.kernels.cpu_fused import rms_norm as fused_cpu

        return fused_cpu(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
        return rms_norm(x, weight, eps, cpu_fused=cpu_fused), x
    if triton_runs_on(x):
        from llmlab.kernels.fused_rmsnorm import rms_norm as fused

        return fused(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor, cpu_fused: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up``: the C++ operator on CPU tensors when ``cpu_fused`` is on (as
    :func:`use_fused`), the fused Triton kernel where it can run, else the PyTorch one."""
    if _cpu_fused(gate, cpu_fused):
        from llmlab.kernels.cpu_fused import silu_mul

        return silu_mul(gate, up)
    if triton_runs_on(gate):
        from llmlab.kernels.fused_swiglu import swiglu as fused

        return fused(gate, up)
    return swiglu_reference(gate, up)


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cpu_fused: bool | None = None
) -> torch.Tensor:
    """Rotary embedding (RoPE, Su et al. 2021) of ``x [N, heads, D]`` by ``cos, sin [N, D]``,
    ``x * cos + rotate_half(x) * sin`` (the arithmetic of :func:`llmlab.model.llama.apply_rotary`
    in token-major layout). The C++ operator on CPU tensors when ``cpu_fused`` is on
    (:func:`llmlab.kernels.cpu_fused.rotary_`: it rotates ``x`` in place and returns it);
    PyTorch otherwise (a new tensor). ``cpu_fused``: as :func:`use_fused`."""
    if _cpu_fused(x, cpu_fused):
        from llmlab.kernels.cpu_fused import rotary_ as fused_cpu

        return fused_cpu(x, cos, sin)
    D = x.shape[-1]
    c, s = cos[:, None], sin[:, None]
    s = torch.cat([-s[..., : D // 2], s[..., D // 2 :]], dim=-1)  # rotate_half's signs
    return x * c + x.roll(D // 2, dims=-1) * s


def _from_env(spec: str) -> KernelSettings:
    s = KernelSettings()
    if spec.strip().lower() in ("0", "off", "false", "none"):
        return KernelSettings(paged_attention="reference")  # PyTorch everywhere
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, _, val = item.partition("=")
        if key == "attention" and val in ATTENTION_IMPLS:
            s.attention = val
        elif key == "paged_attention" and val in PAGED_ATTENTION_IMPLS:
            s.paged_attention = val
        elif key in ("rmsnorm", "swiglu", "packed_linear", "cpu_fused") and val in (
            "",
            "1",
            "true",
            "0",
            "false",
        ):
            setattr(s, key, val in ("", "1", "true"))
        else:
            raise ValueError(
                f"LLMLAB_KERNELS item {item!r} must be attention=<{'|'.join(ATTENTION_IMPLS)}>, "
                f"paged_attention=<{'|'.join(PAGED_ATTENTION_IMPLS)}>, rmsnorm[=0|1], "
                f"swiglu[=0|1], packed_linear[=0|1] or cpu_fused[=0|1] (or LLMLAB_KERNELS=0: no kernel)"
            )
    return s


if os.environ.get("LLMLAB_KERNELS"):
    _settings = _from_env(os.environ["LLMLAB_KERNELS"])

__all__ = [
    "KernelSettings",
    "ATTENTION_IMPLS",
    "PAGED_ATTENTION_IMPLS",
    "enable",
    "disable",
    "use",
    "settings",
    "use_fused",
    "FUSED_KINDS",
    "attention",
    "linear",
    "rms_norm",
    "swiglu",
    "rotary",
    "triton_available",
    "triton_interpreted",
    "triton_runs_on",
    "attention_reference",
    "flash_attention_reference",
    "rms_norm_reference",
    "swiglu_reference",
    "online_softmax",
    "online_softmax_steps",
    "online_softmax_matmul",
    "merge_softmax_partials",
    "softmax_partial",
]
