"""Measure a MoE model under expert parallelism on real ranks: routing, drops, bytes, time.

:func:`ep_probe` is a rank function (``llmlab.launch(ep_probe, dp, dp=dp, ep=ep, ...)``): it
trains the seeded MoE model for a few steps with expert parallelism and the plain gradient sync
of :func:`~llmlab.parallel.expert_parallel.sync_moe_grads` (no bucketing or overlap: this is a
measuring tool, ``llmlab train`` is the trainer), and streams one record per step from rank 0
with :func:`llmlab.report`:

``step, loss`` (global-batch loss), ``tokens_per_expert`` (``[layers][experts]``, whole global
batch), ``imbalance`` (max/mean, mean over layers; ``imbalance_max``: worst layer), ``dropped_tokens`` (routing assignments dropped
over the global batch), ``dropped_fraction``, ``a2a_bytes_per_layer`` (mean payload bytes per rank
per MoE layer this step, forward + backward, split sizes included), ``step_time_s``,
``tokens_per_s``. Used by ``labs/04_expert_parallel.ipynb`` and ``benchmarks/moe_ep.py``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def ep_probe(
    dp: int = 1,
    ep: int = 1,
    steps: int = 5,
    model: str = "tiny-moe",
    global_batch_size: int = 8,
    seq_len: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    tag: str = "",
    device: str = "cpu",
    **model_overrides,
) -> list[dict]:
    """Run on ``dp`` ranks; returns this rank's list of step records (see module doc).

    ``model_overrides`` are :class:`~llmlab.model.config.ModelConfig` fields, e.g.
    ``num_experts_per_tok=1, capacity_factor=1.0, router_aux_loss_coef=0.0``. ``tag`` is copied
    into every record (to tell several runs apart in one ``on_metric`` callback). ``device``:
    ``cpu``, or ``cuda`` (this rank's current GPU; launch with the nccl backend).
    Raises ``ValueError`` if ``ep`` does not divide ``dp`` or the expert count.
    """
    from llmlab.data import BatchLoader
    from llmlab.model.config import get_preset
    from llmlab.model.llama import LlamaForCausalLM
    from llmlab.model.moe import collect_moe_stats, moe_layers
    from llmlab.parallel.expert_parallel import apply_expert_parallel, sync_moe_grads
    from llmlab.runtime import comm
    from llmlab.runtime.launch import report
    from llmlab.runtime.mesh import Mesh
    from llmlab.training.config import TrainConfig
    from llmlab.training.trainer import make_optimizer

    mesh = Mesh.build(dp=dp, ep=ep)
    mc = get_preset(model, **model_overrides)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    net = LlamaForCausalLM(mc, seed=seed).to(dev)
    if ep > 1:
        net = apply_expert_parallel(net, mesh)
    opt = make_optimizer(net.parameters(), TrainConfig(lr=lr))
    loader = BatchLoader(global_batch_size=global_batch_size, seq_len=seq_len, seed=seed)
    n_layers = max(1, len(moe_layers(net)))
    records = []
    for step in range(1, steps + 1):
        x, y = (t.to(dev) for t in loader.local_batch(step, mesh.coords["dp"], dp))
        comm.COUNTER.reset()
        t0 = time.perf_counter()
        loss = net(x, y)
        loss.backward()
        sync_moe_grads(net, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        a2a = torch.tensor([float(comm.COUNTER.bytes["all_to_all"]), loss.item(), dt], dtype=torch.float64)
        if dist.is_initialized() and dp > 1:  # bookkeeping, not counted
            a2a = a2a.to(dev)
            dist.all_reduce(a2a, group=mesh.groups.get("dp"))
            a2a = a2a.cpu() / dp
        stats = collect_moe_stats(net, mesh.groups.get("dp"))
        routed = sum(map(sum, stats["tokens_per_expert"]))
        rec = {
            "step": step,
            "loss": float(a2a[1]),
            "step_time_s": float(a2a[2]),
            "tokens_per_s": global_batch_size * seq_len / float(a2a[2]),
            "a2a_bytes_per_layer": float(a2a[0]) / n_layers,
            "dropped_fraction": stats["dropped_tokens"] / max(1, routed),
            "tag": tag,
        } | stats
        records.append(rec)
        if mesh.rank == 0:
            report(rec)
    return records
