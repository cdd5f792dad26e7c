"""Expert parallelism: each rank holds ``E/ep`` experts; tokens travel to them by all-to-all.

GShard (Lepikhin et al. 2020, §2.2-3.2) and Switch Transformer (Fedus et al. 2021, §2.2) place the
experts of a MoE layer on different devices; Megatron core carves the expert-parallel (EP) groups
out of the data-parallel ranks (``Mesh``: ``dp/ep`` groups of ``ep`` consecutive dp ranks). Each
rank still routes its *own* tokens (its data-parallel slice), then per MoE layer:

1. **split sizes**: ``counts[E]`` (tokens this rank sends to each expert) go through an
   all-to-all, so each rank learns how many rows it will receive from every peer for each of its
   local experts (uneven splits must be known before the payload exchange);
2. **dispatch**: ``all_to_all_single`` of the token rows, sorted by expert, split per
   destination rank (``x [n,h]``: ``n = K*N`` rows when dropless);
3. the rank applies its local experts to the rows it received (regrouped by expert);
4. **combine**: the reverse ``all_to_all_single`` brings each row back to its token's rank,
   where it is weighted and summed exactly as on one device.

Backward is the same two all-to-alls with the splits swapped (:class:`_AllToAll`), so per layer
and micro-batch a rank sends ``2 * K*N*h`` elements forward and as many backward
(``(ep-1)/ep`` of them leave the rank when routing is even).

Gradients. Dense weights (attention, norms, router, embeddings) are replicated and reduced over
``dp`` as usual. An expert's weights live on one rank of each EP group; they are replicated over
the *expert-data-parallel* group ``edp`` (size ``dp/ep``) and must be reduced there. The loss of
the step is the mean of the ``dp`` local losses, so the right expert gradient is
``(1/dp) * sum over all dp ranks``; the EP group already sums its ``ep`` ranks' contributions
through the combine all-to-all, so averaging over ``edp`` alone would be ``ep`` times too large
(Megatron scales expert gradients by ``1/dp``, not ``1/edp``, for this reason). Here the MoE
layer divides its experts' weight gradients by ``ep`` in backward (:class:`_ScaleGrad`, the
token gradients are unchanged), so data parallelism treats both kinds the same way: **average
over the parameter's group** (``dp`` for dense, ``edp`` for a parameter whose
:class:`~llmlab.parallel.records.ParamRecord` says ``expert_parallel``).

Capacity is applied by each rank to its own tokens before dispatch (per-rank capacity, as in
GShard/DeepSpeed): the dropped counts equal a one-rank MoE run on each rank's slice.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmlab.formulas.communication import moe_a2a_bytes as a2a_bytes_formula  # noqa: F401  (re-exported)
from llmlab.model.config import ModelConfig
from llmlab.model.moe import MoE, moe_layers
from llmlab.parallel.grad_reduce import predivide_
from llmlab.parallel.configs import ExpertParallelConfig
from llmlab.parallel.records import param_record
from llmlab.metrics.profiling import phase
from llmlab.runtime import comm
from llmlab.runtime.mesh import Mesh
from llmlab.runtime.comm import Group
from typing import Any, TypeVar, cast


M = TypeVar("M", bound=nn.Module)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd: backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> Any:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        with phase("ep all_to_all forward"):
            comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        with phase("ep all_to_all backward"):
            comm.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Any:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return grad * ctx.scale, None


class ExpertParallelMoE(MoE):
    """A :class:`MoE` holding only experts ``local_experts`` (global ids) of an EP group.

    ``experts`` becomes an ``nn.ModuleDict`` keyed by the global expert id, so parameter names
    (``mlp.experts.5.up_proj.weight``) are the same as in the full model. Built by
    :func:`apply_expert_parallel`, not directly.
    """

    experts: nn.ModuleDict  # type: ignore[assignment]  # keyed by global expert id, not a list
    local_experts: list[int]
    ep_group: Group = None
    ep_size = 1
    ep_rank = 0

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dispatch ``x [n,h]`` (sorted by expert, ``counts [E]``) to the experts' ranks, apply
        them there, and combine back. Returns ``[n,h]`` in the same row order."""
        ep, E = self.ep_size, self.num_experts
        El = E // ep
        # 1. split sizes: counts[r*El:(r+1)*El] go to rank r; we receive [ep, El] counts.
        recv_counts = torch.empty_like(counts)
        comm.all_to_all_single(recv_counts, counts, group=self.ep_group)
        send_counts, recv_counts = counts.view(ep, El), recv_counts.view(ep, El)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        # 2. dispatch
        rows = _AllToAll.apply(x, out_splits, in_splits, self.ep_group)
        # 3. local experts: received rows are (source rank, local expert) blocks; regroup by expert.
        local_id = torch.arange(El, device=x.device).repeat(ep).repeat_interleave(recv_counts.flatten())
        order = torch.argsort(local_id, stable=True)
        per_expert = recv_counts.sum(0).tolist()
        grouped = _ScaleGrad.apply(rows[order], float(ep))
        chunks = grouped.split(per_expert)
        y = torch.cat([self.experts[str(e)](c) for e, c in zip(self.local_experts, chunks)])
        y = _ScaleGrad.apply(y, 1.0 / ep)  # expert weight grads / ep (see module doc)
        y = y[torch.argsort(order)]  # back to (source rank, expert) blocks
        # 4. combine
        out: torch.Tensor = _AllToAll.apply(y, in_splits, out_splits, self.ep_group)
        return out


def apply_expert_parallel(model: M, mesh: Mesh) -> M:
    """Keep this rank's ``E/ep`` experts of every MoE layer of the full (seeded) ``model`` and
    route tokens to the others with all-to-all over ``mesh.groups["ep"]``.

    Rank ``i`` of an EP group holds experts ``[i*E/ep, (i+1)*E/ep)``. Expert parameters are
    recorded ``expert_parallel`` (:func:`~llmlab.parallel.records.param_record`; reduce them over ``mesh.groups["edp"]``, averaging, like
    dense ones over ``dp``; see the module doc for the 1/ep factor). Modifies ``model`` in place
    and returns it. Raises ``ValueError`` if ``mesh.ep`` does not divide the expert count.
    """
    ep = mesh.ep
    ep_rank = mesh.index("ep")
    for layer in moe_layers(model):
        E = layer.num_experts
        check_experts(E, ep)
        El = E // ep
        keep = list(range(ep_rank * El, (ep_rank + 1) * El))
        experts = nn.ModuleDict({str(e): layer.experts[e] for e in keep})
        layer.__class__ = ExpertParallelMoE
        epl = cast(ExpertParallelMoE, layer)
        epl.experts = experts
        epl.local_experts = keep
        epl.ep_group, epl.ep_size, epl.ep_rank = mesh.groups.get("ep"), ep, ep_rank
        for p in experts.parameters():
            param_record(p).expert_parallel = True
    return model


def sync_moe_grads(model: nn.Module, mesh: Mesh) -> None:
    """Average gradients over their data-parallel group: ``edp`` for expert parameters, ``dp``
    for the rest. The plain (no bucketing, no overlap) form of what data parallelism does for a
    MoE model; used by the tests and the lab before ``llmlab.parallel.data_parallel`` exists."""
    for p in model.parameters():
        if p.grad is None:
            continue
        name = "edp" if param_record(p).expert_parallel else "dp"
        group = mesh.groups.get(name)
        if group is not None:  # divided before the sum (llmlab.parallel.grad_reduce)
            comm.all_reduce(predivide_(p.grad, mesh.size(name)), group=group)


# --------------------------------------------------------------------------------------------
# The strategy's contract (llmlab.parallel.protocols)
# --------------------------------------------------------------------------------------------
def validate(config: ExpertParallelConfig, mesh: Mesh, model_config: ModelConfig) -> None:
    """Layout checks for ``llmlab train`` (raise ``ValueError`` naming the constraint): ``mesh.ep
    > 1`` needs a mixture-of-experts model whose expert count it divides. (That ``ep`` divides
    ``dp`` is the mesh's rule, :func:`~llmlab.runtime.mesh.check_degrees`.)"""
    E = model_config.num_experts
    if mesh.ep > 1 and not E:
        raise ValueError(f"ep={mesh.ep} needs a mixture-of-experts model (--model tiny-moe)")
    if E:
        check_experts(E, mesh.ep)


def check_experts(num_experts: int, ep: int) -> None:
    """``ValueError`` unless ``ep`` divides ``num_experts`` (each rank holds ``E/ep`` experts)."""
    if num_experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={num_experts}")


def apply(model: M, mesh: Mesh, config: ExpertParallelConfig) -> M:
    """This rank's experts of ``model`` (:func:`apply_expert_parallel`); ``model`` itself when
    ``mesh.ep`` is 1 (every rank holds every expert, reduced over ``dp`` like the rest)."""
    if mesh.ep == 1:
        return model
    return apply_expert_parallel(model, mesh)
