"""The greedy token of an fp32 ``lm_head`` without every logit: screened in bf16, checked in fp32.

A plain-greedy row (:func:`~llmlab.inference.batched_greedy.is_plain_greedy`: greedy, no
logprobs, no penalties) needs only where its largest logit is, not the logits. In an fp32
decode step the ``lm_head`` is the largest product (SmolLM2-135M: 576 x 49,152 weights, a fifth
of the step's multiply-adds). :class:`GreedyScreen` multiplies bf16 copies of the final hidden
states and of the weight instead (the bf16 panels of :mod:`~llmlab.kernels.panel_linear`:
AVX512-BF16's ``vdpbf16ps``, twice the fp32 rate on half the weight's bytes), bounds how far each
approximate logit can lie from the fp32 one, and recomputes in fp32 only the tokens whose
interval reaches the highest lower end (:func:`~llmlab.kernels.cpu_fused.screened_argmax`; on
SmolLM2-135M's decode rows 4.5 tokens on average, 42 at most, of 49,152). The token is the first
maximum of those fp32 logits.

The bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2002, sec. 2.2 and
3.1), with ``u = 2^-8`` (bf16's unit roundoff), ``g = (K+1) 2^-24 / (1 - (K+1) 2^-24)`` (fp32
sums of ``K+1`` terms) and ``K`` the hidden size:

* rounding ``h`` and ``w_v`` to bf16 moves each product by at most ``(2u + u^2) |h_i w_i|``;
* ``vdpbf16ps`` adds those (exact) products in fp32: at most ``g (1+u)^2 sum |h_i w_i|`` more;
* the result is rounded once to bf16: ``u / (1-u) |approx_v|``;
* an fp32 dot product of ``h`` and ``w_v``, in any order, is within ``g sum |h_i w_i|`` of the
  exact one, and ``sum |h_i w_i| <= |h| |w_v|`` (Cauchy-Schwarz).

So ``|approx_v - logit_v| <= c |h| |w_v| + u' |approx_v|``, ``c = 2u + u^2 + g((1+u)^2 + 1)``,
``u' = u / (1-u)`` (both raised by ``2^-12`` for the fp32 arithmetic of the bound itself; the
kernel adds a term for denormals, which ``vdpbf16ps`` flushes). A token outside the candidates
has a logit below some candidate's, so the first maximum over the candidates is the full row's
argmax, up to fp32 near-ties (where two summation orders of the full product disagree as well:
the same freedom every fp32 kernel choice has).

Where: an fp32 model on a CPU whose bf16 panels run (``avx512_bf16`` at the current level,
:func:`~llmlab.kernels.panel_linear.available`), in a :class:`~llmlab.inference.model_runner.
ModelRunner` with ``packed_linear`` and ``cpu_fused`` on; the bf16 copy of the weight is held
beside the fp32 one (half its bytes again: 57 MB for SmolLM2-135M). A row where something is not
finite comes back not ``ok`` and the runner computes its logits in full (the engine then reports
it as before). Sampling, logprobs and penalties take the full logits. vLLM computes every logit.
"""

from __future__ import annotations

import torch

from llmlab.kernels import cpu_build, cpu_fused, panel_linear

U = 2.0**-8  # bf16's unit roundoff (8 significant bits, round to nearest even)
MARGIN = 1 + 2.0**-12  # for the fp32 arithmetic of the bound itself


def bound_constants(k: int) -> tuple[float, float]:
    """``(c, u')`` of the module's bound for dot products of ``k`` terms."""
    g = (k + 1) * 2.0**-24 / (1 - (k + 1) * 2.0**-24)
    return (2 * U + U * U + g * ((1 + U) ** 2 + 1)) * MARGIN, U / (1 - U) * MARGIN


class GreedyScreen:
    """The screen for one fp32 ``lm_head`` weight ``[V, K]``: its bf16 panels and row norms.

    ``ValueError`` where :meth:`applies` is false for ``weight``."""

    def __init__(self, weight: torch.Tensor):
        if not self.applies(weight):
            raise ValueError(
                "the greedy screen takes a 2-D fp32 CPU weight on a CPU whose bf16 panels run "
                f"(AVX512-BF16); got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
            )
        self.weight = weight.detach().contiguous()
        self.panels = panel_linear.pack(self.weight.bfloat16())
        # |w_v| from fp64, raised so that fp32 rounding cannot make it smaller
        self.norms = (self.weight.double().norm(dim=1) * (1 + 2.0**-20)).float()
        self.c, self.u = bound_constants(weight.shape[1])

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        """Whether ``weight`` can be screened here: 2-D fp32 on the CPU, the C++ kernels built,
        and bf16 panels at the current level (``LLMLAB_CPU_ISA`` below ``avx512_bf16``: no)."""
        return (
            weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.numel() > 0
            and cpu_build.available()
            and panel_linear.available(torch.bfloat16)
        )

    def argmax(self, hidden: torch.Tensor) -> tuple[list[int], list[bool]] | None:
        """The greedy tokens of ``hidden [R, K]`` (fp32, the ``lm_head``'s input) and whether
        each is known (``False``: compute that row's logits in full); ``None`` where the bf16
        panels cannot run at the current level any more (``LLMLAB_CPU_ISA`` lowered since)."""
        h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        approx = panel_linear.linear(h.bfloat16(), self.panels, self.weight.shape[0])
        if approx is None:
            return None
        idx, ok = cpu_fused.screened_argmax(h, approx, self.weight, self.norms, self.c, self.u)
        return idx.tolist(), ok.tolist()
