"""W8A8 dynamic quantisation of a served model: int8 weights and int8 activations in every linear.

``quantization="w8a8"`` (:class:`~llmlab.inference.engine_config.EngineConfig`, ``--quantization
w8a8``): after the :class:`~llmlab.inference.model_runner.ModelRunner` has fused q/k/v and gate/up
into one weight each, every decoder linear (the fused q/k/v, ``o_proj``, the fused gate/up,
``down_proj``) is stored as int8 with one scale per output channel, and its input is quantised per
token at run time from its measured range; the product runs in int8 with int32 sums
(:mod:`llmlab.kernels.int8_linear`). Kept in the weights' dtype (fp32 or bf16): the token
embedding, the RMSNorms, attention itself (scores, softmax, the KV cache) and the output head
``lm_head`` (``skip``; the layer most sensitive to quantisation, and tied to the embedding in
small models). The float weights of the quantised layers are released.

Before that (``smoothquant_alpha > 0``, the default), the engine smooths the float model
(:mod:`llmlab.inference.smooth_quant`, SmoothQuant §4): each linear input's outlier channels are
divided by per-channel factors folded into the RMSNorm weights (q/k/v, gate/up) and ``up_proj``'s
rows (``down_proj``), and the weight columns multiplied by them, so that per-token int8 loses less
of the other channels (on SmolLM2-135M the perplexity cost fell from +2.28 % to the figure in
docs/inference.md's W8A8 section).

The weight-only mode (``"int8-weight-only"``, alias ``"int8"``) is :mod:`llmlab.model.quantize`.
"""

from __future__ import annotations

import torch
from torch import nn

from llmlab.kernels.int8_linear import pack, path, quantize_per_channel, w8a8_linear

FUSED = {"fused_qkv": ("q_proj", "k_proj", "v_proj"), "fused_gate_up": ("gate_proj", "up_proj")}


class W8A8Linear(nn.Module):
    """``[..., in] -> [..., out]``: :func:`~llmlab.kernels.int8_linear.w8a8_linear` with ``qw`` int8
    ``[out, in]``, ``sw`` fp32 ``[out]`` and ``bias`` (the layer's dtype) or ``None``. On the
    ``"onednn"`` path the weight is reordered for oneDNN once, at the first call (``packed``; the
    int8 slices of a fused weight, never called by the engine, are never packed)."""

    qw: torch.Tensor
    sw: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("qw", qw)
        self.register_buffer("sw", sw)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.out_features, self.in_features = qw.shape
        self.kernel = path()
        self.packed: torch.Tensor | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> W8A8Linear:
        qw, sw = quantize_per_channel(weight)
        return cls(qw, sw, bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel == "onednn" and self.packed is None:
            self.packed = pack(self.qw)
        return w8a8_linear(x, self.qw, self.sw, self.bias, self.kernel, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def _stub(layer: W8A8Linear) -> torch.Tensor:
    """An empty tensor standing for a fused weight: :func:`llmlab.kernels.linear` finds ``layer``
    on it (``_packed``) and calls it."""
    stub = torch.empty(0)
    stub._packed = layer  # type: ignore[attr-defined]
    return stub


def _quantize_fused(parent: nn.Module, attr: str, views: tuple[str, ...]) -> int:
    """The fused ``(weight, bias, split)`` of ``parent`` as one :class:`W8A8Linear` (kept as
    ``parent.<attr>_w8a8``); the layers it fused become int8 slices of it. Returns 1, or 0 if unfused."""
    fused = getattr(parent, attr, None)
    if fused is None:
        return 0
    w, b, split = fused
    layer = W8A8Linear.from_weight(w, b)
    setattr(parent, f"{attr}_w8a8", layer)
    setattr(parent, attr, (_stub(layer), None, split))
    r = 0
    for name, n in zip(views, split):
        sub = W8A8Linear(layer.qw[r : r + n], layer.sw[r : r + n], None if b is None else b[r : r + n])
        setattr(parent, name, sub)
        r += n
    return 1


@torch.no_grad()
def quantize_w8a8(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Quantise ``model`` in place (after ``fuse_projections``): fused projections and every other
    linear (``nn.Linear`` or a layer with ``weight`` [out, in] whose class name ends in ``Linear``,
    e.g. a packed one) whose name contains no entry of ``skip``. Returns the number of products
    that now run in int8."""
    n = 0
    for name, parent in list(model.named_modules()):
        done: set[str] = set()
        for attr, views in FUSED.items():
            if _quantize_fused(parent, attr, views):
                n += 1
                done.update(views)
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if (
                child_name in done
                or any(s in full for s in skip)
                or isinstance(child, W8A8Linear)
                or not type(child).__name__.endswith("Linear")
                or getattr(child, "weight", None) is None
                or child.weight.dim() != 2
            ):
                continue
            setattr(parent, child_name, W8A8Linear.from_weight(child.weight, child.bias))
            n += 1
    return n


def linear_bytes(model: nn.Module) -> int:
    """Bytes of the weights the model's linear products read: int8 weights plus their scales, and
    the float weights of the linears left unquantised (``lm_head``), biases excluded."""
    total, seen = 0, set()
    for m in model.modules():
        if isinstance(m, W8A8Linear):
            key = m.qw.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += m.qw.untyped_storage().nbytes() + m.sw.untyped_storage().nbytes()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total
