"""The global gradient norm, the overflow decision and clipping, agreed by every rank.

Megatron-LM's ``clip_grad_norm_fp32`` (Shoeybi et al. 2019; ``megatron/core/optimizer/clip_grads.py``):
the norm of the *whole model's* gradient, whatever the layout, is

    ||g|| = sqrt( sum over every parameter element, counted once, of g^2 )

Each rank sums the squares of the gradient elements it *owns* and one all-reduce over all ranks
adds them up. Ownership makes every element count exactly once:

* tensor parallelism: a sharded weight's slice is owned by its rank; a replicated one (norm
  weights, row-parallel biases, experts under TP, kv heads copied on several ranks) only by the
  first copy (its record's ``tp_duplicate`` is ``False`` there, set by
  :func:`llmlab.parallel.tp_plan.apply_tensor_parallel`; :mod:`llmlab.parallel.records`);
* pipeline parallelism: stages hold different parameters;
* data (and context) parallelism: after the all-reduce every replica holds the same gradient, so
  only data-parallel index 0 (context-parallel index 0) owns it (expert-data-parallel index 0 for
  experts); under ZeRO each rank owns the
  gradient *shard* it holds, and the shards are disjoint.

The same all-reduce carries a count of non-finite elements over *everything* a rank holds
(duplicates included), so one overflow anywhere makes every rank skip the step, in every dtype
(fp16 also halves its scale, Micikevicius et al. 2018, §3.2): one decision per step for the model.

The all-reduce (two float64 numbers) goes straight to ``torch.distributed``, like the loss
bookkeeping, so the strategies' communication counters keep matching their formulas.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from llmlab.parallel.records import param_record


def owns(p: torch.Tensor, mesh, sharded_over_dp: bool) -> bool:
    """Whether this rank counts ``p``'s gradient in the global norm (see module doc)."""
    rec = param_record(p)
    if rec.tp_duplicate:
        return False
    if sharded_over_dp:
        return True
    if mesh.coords.get("cp", 0) != 0:  # context-parallel ranks hold the same reduced gradient
        return False
    if rec.expert_parallel:
        return mesh.index("edp") == 0
    return mesh.coords["dp"] == 0


@torch.no_grad()
def global_grad_norm(pieces: list[tuple[torch.Tensor, bool]], device) -> tuple[float, bool]:
    """``(norm, finite)`` of the model's gradient from this rank's ``(gradient, owned)`` pieces.

    Collective over every rank of the job (one all-reduce of two float64 values). ``finite`` is
    ``False`` on every rank if any rank holds an inf or nan gradient element.
    """
    sq = torch.zeros((), dtype=torch.float64, device=device)
    bad = torch.zeros((), dtype=torch.float64, device=device)
    for g, owned in pieces:
        g32 = g.detach().float()
        bad += (~torch.isfinite(g32)).sum()
        if owned:
            sq += g32.pow(2).sum().double()
    t = torch.stack([sq, bad])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    sq, bad = t.tolist()
    finite = bad == 0 and math.isfinite(sq)
    return (math.sqrt(sq) if finite else float("nan")), finite


@torch.no_grad()
def clip_(grads: list[torch.Tensor], max_norm: float, norm: float) -> float:
    """Scale ``grads`` in place by ``max_norm / (norm + 1e-6)`` when that is below 1 (as
    ``torch.nn.utils.clip_grad_norm_``); returns the factor applied (1.0 if none). Raises
    ``FloatingPointError`` for a non-finite ``norm`` (that step must be skipped, not clipped:
    multiplying by ``max_norm / inf = 0`` or ``nan`` would write zeros or NaN everywhere)."""
    if not math.isfinite(norm):
        raise FloatingPointError(f"clip_ got a non-finite gradient norm {norm}: skip the step")
    coef = max_norm / (norm + 1e-6)
    if coef >= 1.0:
        return 1.0
    for g in grads:
        g.mul_(coef)
    return coef
