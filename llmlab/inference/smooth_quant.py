"""SmoothQuant: per-channel smoothing that moves activation outliers into the weights before W8A8.

Xiao et al. 2023, "SmoothQuant" (ICML), §4: a linear's input ``X [T, in]`` has a few channels whose
range is far above the rest, so one per-token int8 scale (set by the outlier) leaves the other
channels few levels. Dividing input channel ``j`` by ``s_j`` and multiplying weight column ``j`` by
the same ``s_j`` leaves the product unchanged, ``(X diag(s)^-1)(diag(s) W^T) = X W^T``, and with

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

(``max|X_j|`` measured on calibration text, ``max|W_j|`` over the weight's column ``j``, of all the
linears that read ``X``) the two ranges meet in the middle: ``alpha`` is the migration strength.
The division is folded into the operator before, so nothing is added at run time and the float
model computes the same function (up to rounding):

* fused q/k/v input: ``input_layernorm``'s weight divided by ``s`` (RMSNorm: ``w * x / rms(x)``);
* fused gate/up input: ``post_attention_layernorm``'s weight divided by ``s``;
* ``down_proj`` input ``silu(gate) * up`` (linear in ``up``): ``up_proj``'s rows (and bias) divided
  by ``s``.

Smoothing is done on the unfused model (``q_proj`` ... ``down_proj`` as ``nn.Linear``), in place,
before the engine fuses and quantises it (:mod:`llmlab.inference.quantize_w8a8`). A decoder layer
whose feed-forward is not the dense :class:`~llmlab.model.layers.MLP` (a mixture of experts) has only
its q/k/v input smoothed. ``o_proj`` is not smoothed (through ``v_proj``'s rows, one factor per
key/value channel shared by its query heads, it would be exact too, but on SmolLM2-135M it did not
lower the divergence from fp32 consistently; docs/inference.md).

Calibration (:func:`calibration_ids`): the first ``n * seq_len`` tokens of the bundled corpus
(:func:`llmlab.data.load_corpus`, from its start; held-out evaluations use its end) through the
model's tokenizer, as ``n`` sequences; one forward of the decoder layers (no output head) in the
model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmlab.data import load_corpus
from llmlab.model.layers import MLP

ALPHA = 0.6  # migration strength, chosen on validation text (docs/inference.md, W8A8)
CALIBRATION_SEQS, CALIBRATION_LEN = 8, 128  # 1,024 tokens: about 1 s for SmolLM2-135M


def calibration_ids(
    tokenizer: object | None, vocab_size: int, n: int = CALIBRATION_SEQS, seq_len: int = CALIBRATION_LEN
) -> torch.Tensor:
    """``[n, seq_len]`` int64 token ids: the start of the bundled corpus through ``tokenizer``
    (anything with ``encode(str) -> list[int]``), or, without a tokenizer (a model given as a
    config, random weights), seeded random ids below ``vocab_size``. Raises ``ValueError`` when
    the tokenizer gives ids outside the vocabulary."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (n, seq_len), generator=g)
    text, chars = load_corpus(), 8 * n * seq_len  # a token is at most a few characters
    ids: list[int] = []
    while len(ids) < n * seq_len and chars < 2 * len(text):
        ids = list(tokenizer.encode(text[:chars]))  # type: ignore[attr-defined]
        chars *= 2
    ids = (ids * (1 + n * seq_len // max(len(ids), 1)))[: n * seq_len]
    out = torch.tensor(ids, dtype=torch.long).view(n, seq_len)
    if out.numel() and not 0 <= int(out.min()) <= int(out.max()) < vocab_size:
        raise ValueError(f"calibration ids outside the vocabulary of {vocab_size}: wrong tokenizer?")
    return out


def _absmax(x: torch.Tensor) -> torch.Tensor:
    """``x [..., c]`` -> ``[c]`` fp32: each channel's largest magnitude over all tokens."""
    return x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()


@torch.no_grad()
def activation_absmax(model: Any, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, the per-input-channel ``max|X_j|`` (fp32) of ``"qkv"`` (the output of
    ``input_layernorm``), ``"gate_up"`` (of ``post_attention_layernorm``) and ``"down"`` (the input
    of ``down_proj``, dense MLP only) over one forward of ``ids [n, T]`` through the decoder layers
    (``model.embed``, ``model.run_layers``; no output head)."""
    stats: list[dict[str, torch.Tensor]] = [{} for _ in model.model.layers]
    handles = []

    def keep(i: int, key: str, x: torch.Tensor) -> None:
        m = _absmax(x)
        stats[i][key] = m if key not in stats[i] else torch.maximum(stats[i][key], m)

    for i, layer in enumerate(model.model.layers):
        handles.append(
            layer.input_layernorm.register_forward_hook(lambda _m, _a, out, i=i: keep(i, "qkv", out))
        )
        handles.append(
            layer.post_attention_layernorm.register_forward_hook(
                lambda _m, _a, out, i=i: keep(i, "gate_up", out[0] if isinstance(out, tuple) else out)
            )
        )
        if isinstance(layer.mlp, MLP):
            handles.append(
                layer.mlp.down_proj.register_forward_pre_hook(lambda _m, args, i=i: keep(i, "down", args[0]))
            )
    try:
        model.run_layers(model.embed(ids.to(model.lm_head.weight.device)))
    finally:
        for h in handles:
            h.remove()
    return stats


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """``s [in]`` fp32 for ``max|X_j|`` ``act_absmax [in]`` and the weights ``[out_k, in]`` that read
    ``X``: ``max|X_j|^alpha / max|W_j|^(1-alpha)`` (both clamped at 1e-5, as SmoothQuant's code);
    a channel that was never nonzero gets 1."""
    w = torch.stack([x.detach().abs().amax(dim=0).float() for x in weights]).amax(dim=0)
    s = act_absmax.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1 - alpha)
    return torch.where(act_absmax > 0, s, torch.ones_like(s))


def _fold_into_norm(norm: Any, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """``norm.weight /= s``, each ``linear.weight[:, j] *= s_j`` (in place: fused views follow)."""
    norm.weight.data.div_(s.to(norm.weight.dtype))
    for lin in linears:
        lin.weight.data.mul_(s.to(lin.weight.dtype))


@torch.no_grad()
def smooth(model: Any, ids: torch.Tensor, alpha: float = ALPHA) -> int:
    """Smooth ``model`` (a :class:`~llmlab.model.llama.LlamaForCausalLM`) in place from the
    activations of ``ids [n, T]`` (:func:`activation_absmax`) with migration strength ``alpha``
    (0 < alpha <= 1, ``ValueError`` otherwise); see the module note for where each factor is
    folded. Returns the number of linear inputs smoothed."""
    if not 0 < alpha <= 1:
        raise ValueError(f"SmoothQuant alpha={alpha} must be in (0, 1]")
    return fold(model, activation_absmax(model, ids), alpha)


@torch.no_grad()
def fold(model: Any, stats: list[dict[str, torch.Tensor]], alpha: float) -> int:
    """:func:`smooth` from measured ``stats`` (:func:`activation_absmax` of the same model):
    the factors of each linear input, folded into the operator before it. Returns their count."""
    n = 0
    for layer, st in zip(model.model.layers, stats):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        _fold_into_norm(
            layer.input_layernorm, qkv, smoothing_factors(st["qkv"], [m.weight for m in qkv], alpha)
        )
        n += 1
        if not isinstance(mlp, MLP):
            continue
        gate_up = [mlp.gate_proj, mlp.up_proj]
        s = smoothing_factors(st["gate_up"], [m.weight for m in gate_up], alpha)
        _fold_into_norm(layer.post_attention_layernorm, gate_up, s)
        s = smoothing_factors(st["down"], [mlp.down_proj.weight], alpha)
        mlp.up_proj.weight.data.div_(s.to(mlp.up_proj.weight.dtype)[:, None])
        if mlp.up_proj.bias is not None:
            mlp.up_proj.bias.data.div_(s.to(mlp.up_proj.bias.dtype))
        mlp.down_proj.weight.data.mul_(s.to(mlp.down_proj.weight.dtype))
        n += 2
    return n
