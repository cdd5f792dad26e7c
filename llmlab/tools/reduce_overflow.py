"""Why a data-parallel gradient average divides *before* the sum, measured on real fp16 gradients.

:func:`fp16_mean_probe` is a rank function (``llmlab.launch(fp16_mean_probe, 8)``): every rank
runs forward and backward of the seeded model in fp16 on its rows of the global batch of step 1,
with the loss multiplied by the fp16 loss scale (as the trainer's first step does), and then
averages its flat gradient over the ``dp`` ranks with one real all-reduce each way, by
:func:`llmlab.parallel.grad_reduce.mean_over_ranks`: divided by N before the sum (llmlab's rule:
:func:`~llmlab.parallel.grad_reduce.predivide_`, what DDP and ZeRO do) and after it. It returns,
on every rank, the largest |gradient| any rank held and the non-finite element counts of both
averages. Used by ``labs/08_3d_parallelism.ipynb``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def fp16_mean_probe(
    model: str = "tiny",
    global_batch_size: int = 8,
    seq_len: int = 32,
    seed: int = 0,
    loss_scale: float = 2.0**16,
) -> dict:
    """Run on ``dp`` gloo/NCCL ranks (``dp`` = the world size, which must divide
    ``global_batch_size``). Returns ``{"dp", "numel", "max_abs_rank_grad", "inf_rank_grads",
    "inf_post_divided", "inf_pre_divided", "max_abs_pre_divided"}``: the largest |fp16 scaled
    gradient element| over every rank, how many of them are non-finite (summed over ranks), and
    how many elements of the summed-then-divided and divided-then-summed averages are."""
    from llmlab.data import BatchLoader
    from llmlab.model.llama import LlamaForCausalLM
    from llmlab.parallel.grad_reduce import mean_over_ranks
    from llmlab.runtime.mesh import Mesh
    from llmlab.training.config import TrainConfig, model_config

    dp = dist.get_world_size() if dist.is_initialized() else 1
    mesh = Mesh.build(dp=dp)
    cfg = TrainConfig(
        model=model, dp=dp, global_batch_size=global_batch_size, seq_len=seq_len, seed=seed, dtype="fp16"
    )
    net = LlamaForCausalLM(model_config(cfg), seed=seed).half()
    loader = BatchLoader(global_batch_size=global_batch_size, seq_len=seq_len, seed=seed)
    ((x, y),) = loader.microbatches(1, mesh.coords["dp"], dp, 1)
    (net(x, y) * loss_scale).backward()
    g = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])
    group = mesh.groups.get("dp")
    pre, post = mean_over_ranks(g, group), mean_over_ranks(g, group, predivide=False)
    stats = torch.tensor(
        [g.float().abs().max().item(), (~torch.isfinite(g)).sum().item()], dtype=torch.float64
    )
    if dp > 1:  # bookkeeping: the largest element and the non-finite count over the ranks
        dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(stats[1:])
    return {
        "dp": dp,
        "numel": g.numel(),
        "max_abs_rank_grad": stats[0].item(),
        "inf_rank_grads": int(stats[1].item()),
        "inf_post_divided": int((~torch.isfinite(post)).sum()),
        "inf_pre_divided": int((~torch.isfinite(pre)).sum()),
        "max_abs_pre_divided": pre.float().abs().max().item(),
    }
