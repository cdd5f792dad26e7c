"""Linear layers with weights prepacked for oneDNN: the inference engine's GEMM on CPU.

``F.linear`` on a CPU tensor hands its row-major weight to the GEMM library on every call, which
first reorders it into the blocked layout its kernels read; in a decode step (a few dozen rows
against the whole weight) that reorder and the unblocked reads cost as much as the product. vLLM's
CPU backend reorders each weight once, at load time, for oneDNN; :func:`pack_linears` does the
same through PyTorch's own oneDNN ops (the ones Inductor's weight prepacking emits), and
:func:`linear` then multiplies by the packed copy. The arithmetic is a matrix product either way
(fp32 accumulation; the summation order is oneDNN's, so fp32 results differ from ``F.linear`` by
rounding only). Measured on this repository's 2-CPU machine: 1.3-2x faster at 8-64 rows in bf16,
about 1.1-1.5x in fp32, the same at thousands of rows (docs/inference.md).

Select it with ``llmlab.kernels.enable(packed_linear=True)`` or
``LLMLAB_KERNELS=packed_linear``; the engine's :class:`~llmlab.inference.model_runner.ModelRunner`
then packs its model's plain ``nn.Linear`` layers (and the fused q/k/v and gate/up weights) on a
CPU device. The packed copy is kept beside the weight (the weight stays, for ``state_dict`` and
the reference path): the linear layers' weight memory doubles.

On a CPU with AMX, a bf16 weight whose dimensions are multiples of 32 also gets a copy in AMX
tile layout (:mod:`~llmlab.kernels.amx_linear`), which products of up to 48 rows (decode
steps) take: there the weight's stream from memory sets the speed, and that kernel streams it
faster than oneDNN. Such weights are then held three times (the weight, oneDNN's copy and the
tiles). Likewise, on a CPU with AVX2 or AVX-512, an fp32 weight gets a copy in panels of 32 outputs
(:mod:`~llmlab.kernels.panel_linear`) for products of up to 64 rows, which it streams from
memory while it computes instead of waiting on it; with AVX512-BF16, a bf16 weight the AMX
tiles do not take gets one too, which products of any size take.

Which CPUs: PyTorch's oneDNN ops pack fp32 weights on any x86-64, bf16 ones only with AVX-512
BW/VL/DQ or AVX-NE-CONVERT and fp16 ones only with AVX512-FP16 or AVX-NE-CONVERT (elsewhere
they raise). :func:`path` chooses by the CPU's flags (:mod:`~llmlab.kernels.cpu_isa`, lowered by
``LLMLAB_CPU_ISA``) and by a one-off trial pack of a small weight. Where oneDNN packs fp32 but
not the weight's bf16/fp16 (an AVX2-only CPU), it says ``"onednn-fp32"``: :func:`pack` packs the
weight widened to fp32 (exactly: every bf16/fp16 value is an fp32 value) and :func:`linear`
multiplies the widened input by it and rounds the product back, which is what a bf16 GEMM does
(fp32 accumulation, one rounding of each output) at the fp32 packed product's speed: on an AVX-512
core limited to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``), 3-5x faster than PyTorch's own bf16
``F.linear`` there from 16 rows up (docs/kernels.md); below :data:`WIDENED_MIN_ROWS` rows
(:data:`WIDENED_MIN_ROWS_PANELS` where the widened weight also has fp32 panels, which products of
up to 64 rows take as an fp32 weight's do) ``F.linear``, which reads half the bytes, is faster and
runs instead. The widened copies cost twice the bf16 weight's bytes each. Where
it says ``"aten"``, :func:`pack` leaves the weight unpacked and :func:`linear` is ``F.linear``:
the same product.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from llmlab.kernels import amx_linear, cpu_isa, panel_linear

BATCH_HINT = 64  # rows oneDNN picks its blocking for (decode-sized; any row count works)
# "onednn-fp32": below this many rows F.linear's own bf16/fp16 product, which reads half the
# weight's bytes, is the faster one (crossover at 3-4 rows against oneDNN, 1-2 against the fp32
# panels: docs/kernels.md)
WIDENED_MIN_ROWS = 4
WIDENED_MIN_ROWS_PANELS = 2


def available() -> bool:
    """Whether PyTorch was built with oneDNN (mkldnn), whose linear ops the packing uses."""
    return torch.backends.mkldnn.is_available()


# The CPU flags oneDNN's packed linear needs per dtype (any one of the sets; PyTorch's own checks).
NEEDS: dict[torch.dtype, list[frozenset[str]]] = {
    torch.float32: [frozenset()],
    torch.bfloat16: [frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"})],
    torch.float16: [frozenset({"avx512_fp16"}), frozenset({"avx_ne_convert"})],
}


@functools.cache
def _trial_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies a small ``dtype`` weight here (it raises where the CPU,
    or ``ONEDNN_MAX_CPU_ISA``, lacks what the dtype needs)."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), BATCH_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype), w, None, "none", [], "")
        return True
    except RuntimeError:
        return False


def path(dtype: torch.dtype, flags: frozenset[str] | None = None) -> str:
    """Which product :func:`linear` runs for packed ``dtype`` weights: ``"onednn"`` (prepacked)
    where PyTorch has oneDNN, the CPU has the flags :data:`NEEDS` lists for ``dtype`` and a trial
    pack succeeds; else, for bf16 and fp16, ``"onednn-fp32"`` (the weight widened to fp32 and
    prepacked) where fp32 is ``"onednn"``; else ``"aten"`` (``F.linear``). ``flags``: judge that
    flag set instead of this CPU's (:func:`llmlab.kernels.cpu_isa.effective_flags`), without the
    trial."""
    if not available() or dtype not in NEEDS:
        return "aten"
    have = cpu_isa.effective_flags() if flags is None else frozenset(flags)
    if any(need <= have for need in NEEDS[dtype]) and (flags is not None or _trial_pack(dtype)):
        return "onednn"
    if dtype != torch.float32 and path(torch.float32, flags) == "onednn":
        return "onednn-fp32"
    return "aten"


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """Attach ``weight [out, in]``'s oneDNN-blocked copy to it (``weight._packed``; in fp32
    where :func:`path` is ``"onednn-fp32"``) and return the copy; where :func:`path` is ``"aten"``
    for its dtype, leave it unpacked and return ``None``. CPU tensors in fp32, bf16 or fp16 only
    (``ValueError`` otherwise)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"packed linear weights are CPU fp32/bf16/fp16, got {weight.dtype} on {weight.device}"
        )
    how = path(weight.dtype)
    if how == "aten":
        return None
    # "onednn-fp32": oneDNN packs fp32 only here, so the copies hold the weight's exact fp32 widening
    w = weight.detach() if how == "onednn" else weight.detach().float()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
    setattr(weight, "_packed", packed)  # (a Tensor attribute the stubs do not declare)
    if amx_linear.fits(w) and amx_linear.available():  # decode-sized batches: AMX tiles
        setattr(weight, "_amx", amx_linear.pack(w))
    elif panel_linear.fits(w) and panel_linear.available(w.dtype):  # else: panels
        setattr(weight, "_panels", panel_linear.pack(w))
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., in]`` -> ``[..., out]``), through the packed copy
    when :func:`pack` attached one to ``weight`` (or through the module attached in its place:
    :mod:`llmlab.inference.quantize_w8a8`)."""
    packed = getattr(weight, "_packed", None)
    if packed is None:
        return F.linear(x, weight, bias)
    if not isinstance(packed, torch.Tensor):  # a layer standing in for the weight (W8A8, int8)
        return packed(x, bias)
    if packed.dtype != weight.dtype:  # "onednn-fp32": widen, multiply in fp32, round once
        few = WIDENED_MIN_ROWS_PANELS if hasattr(weight, "_panels") else WIDENED_MIN_ROWS
        if x.numel() < few * x.shape[-1]:
            return F.linear(x, weight, bias)
        return _product(x.float(), weight, packed, None if bias is None else bias.float()).to(weight.dtype)
    return _product(x, weight, packed, bias)


def _product(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x`` times ``weight``'s packed copies (``packed``'s dtype): its AMX tiles or panels where
    it has them and the row count suits them, else oneDNN."""
    amx = getattr(weight, "_amx", None)
    if amx is not None and bias is None and 0 < x.numel() <= amx_linear.MAX_ROWS * x.shape[-1]:
        y = amx_linear.linear(x, amx)
        if y is not None:
            return y
    panels = getattr(weight, "_panels", None)
    if panels is not None and 0 < x.numel() <= panel_linear.max_rows(panels.dtype) * x.shape[-1]:
        y = panel_linear.linear(x, panels, weight.shape[0], bias)
        if y is not None:
            return y
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def panels_for(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The panels (:func:`llmlab.kernels.panel_linear.pack`) that :func:`linear` multiplies
    ``rows`` rows of ``weight``'s dtype by, or ``None`` where it would take another path there
    (not packed, a stand-in layer, a widened weight, AMX tiles, more rows than the panels take, or
    no kernel in the build for the current level)."""
    packed = getattr(weight, "_packed", None)
    panels = getattr(weight, "_panels", None)
    if panels is None or not isinstance(packed, torch.Tensor) or packed.dtype != weight.dtype:
        return None
    if getattr(weight, "_amx", None) is not None and rows <= amx_linear.MAX_ROWS:
        return None
    if not 0 < rows <= panel_linear.max_rows(panels.dtype) or not panel_linear.runs(panels.dtype):
        return None
    return panels


def swiglu_panels_for(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The SwiGLU panels :func:`gate_up_swiglu` multiplies by for the fused gate/up ``weight``
    (and ``bias``), or ``None`` where it returns ``None``."""
    panels = getattr(weight, "_swiglu", None)
    if panels is None or bias is not None or weight.dtype != torch.bfloat16:
        return None
    return panels if panel_linear.runs(torch.bfloat16) else None


def gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``silu(gate) * up`` of the fused gate/up product ``x [..., in]`` -> ``[..., I]`` in one
    pass where :func:`pack_linears` gave ``weight`` SwiGLU panels (bf16 on a CPU with
    AVX512-BF16 and no AMX: :func:`~llmlab.kernels.panel_linear.swiglu`); ``None`` otherwise
    (the caller multiplies, then applies SwiGLU)."""
    panels = getattr(weight, "_swiglu", None)
    if panels is None or bias is not None or x.dtype != torch.bfloat16:
        return None
    return panel_linear.swiglu(x, panels, weight.shape[0] // 2)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose forward is :func:`linear` on its packed weight: ``[..., in] ->
    [..., out]``. Holds the same ``weight`` and ``bias`` parameters (so ``state_dict`` keys and
    tied weights are unchanged)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias
        pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# The fused projections of llmlab.model and the layers whose weights are views of them (unused
# once fused: they are not packed).
FUSED = {"fused_qkv": ("q_proj", "k_proj", "v_proj"), "fused_gate_up": ("gate_proj", "up_proj")}


def pack_linears(model: nn.Module) -> int:
    """Pack ``model`` in place: every plain ``nn.Linear`` the forward calls becomes a
    :class:`PackedLinear`, and the fused projection weights (``fused_qkv``, ``fused_gate_up``)
    get their packed copies (the layers whose weights are views of them stay as they are, unused;
    a bf16 fused gate/up weight with panels and no bias also gets SwiGLU panels, for
    :func:`gate_up_swiglu`);
    returns the number of weights packed (0 where :func:`path` is ``"aten"``: the layers then
    run ``F.linear``). Layers of other types (int8, tensor-parallel) are left
    as they are."""
    n = 0
    for parent in list(model.modules()):
        skip: set[str] = set()
        for attr, views in FUSED.items():
            fused = getattr(parent, attr, None)
            if fused is not None:
                n += pack(fused[0]) is not None
                skip.update(views)
                w, b, split = fused
                if (
                    attr == "fused_gate_up"
                    and b is None
                    and getattr(getattr(w, "_panels", None), "dtype", None) == torch.bfloat16  # (not widened)
                ):
                    setattr(w, "_swiglu", panel_linear.pack_swiglu(w, split[0]))  # SwiGLU as its epilogue
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in skip:
                setattr(parent, name, PackedLinear(child))
                n += hasattr(child.weight, "_packed")
    return n
