"""What this machine offers, and the size a lab runs at here.

Labs call :func:`lab_size` at the top, so the same notebook runs unchanged on a CPU laptop (several
gloo processes, the tiny model), one GPU, or a node of several GPUs (one rank per GPU, NCCL, a
bigger model), and shows the chosen size.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass
class LabSize:
    """How a lab runs on this machine.

    ``kind``: ``cpu``, ``gpu`` (one) or ``multi-gpu``; ``device``: ``cpu``/``cuda``;
    ``world_size``: ranks the lab launches (at most ``max_ranks``); ``backend``: gloo or nccl;
    ``model``: the preset sized for the hardware; ``steps``: training steps for demos.
    """

    kind: str
    device: str
    world_size: int
    backend: str
    model: str
    steps: int
    num_gpus: int
    cpu_cores: int

    def describe(self) -> str:
        where = (f"{self.num_gpus} GPU{'s' if self.num_gpus != 1 else ''}" if self.device == "cuda"
                 else f"CPU ({self.cpu_cores} cores)")
        return (f"lab size: {self.kind} - {self.world_size} ranks on {where}, {self.backend}, "
                f"model '{self.model}', {self.steps} steps")

    def as_dict(self) -> dict:
        return asdict(self)


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def lab_size(max_ranks: int = 4, min_ranks: int = 2, force_cpu: bool | None = None, *,
             cpu_model: str = "tiny", gpu_model: str | None = None, cpu_steps: int = 20,
             gpu_steps: int = 200, fits=None) -> LabSize:
    """Choose a lab's size from the hardware.

    ``LLMLAB_DEVICE=cpu`` (or ``force_cpu=True``) keeps a lab on CPU ranks even with GPUs. On CPU
    the lab uses ``min_ranks`` gloo processes (the 2-core laptop target); with N >= ``min_ranks``
    GPUs it uses ``min(N, max_ranks)`` ranks, one GPU each; with one GPU, one rank... unless the
    lab needs ``min_ranks`` > 1, in which case it falls back to CPU ranks (NCCL cannot put two
    ranks on one GPU). Single-process labs use ``max_ranks=1, min_ranks=1``: one rank, on the
    GPU if there is one.

    A lab whose model must meet a constraint (an MoE preset; ``tp`` dividing the heads; ``pp``
    dividing the layers) names its presets: ``cpu_model`` on CPU, ``gpu_model`` on GPUs (default:
    ``small`` below 8 GPUs, ``base`` from 8). ``cpu_steps``/``gpu_steps``: its demo length.
    ``fits(ranks, model)``: ``None`` when the lab's layouts are valid at that many ranks, else the
    reason; the largest fitting count from ``min(N, max_ranks)`` down to ``min_ranks`` is taken
    (3 GPUs give tp = 2 on 8 heads, not 3), and CPU ranks if none fits.
    """
    cores = os.cpu_count() or 1
    n = gpu_count()
    if force_cpu is None:
        force_cpu = os.environ.get("LLMLAB_DEVICE", "").lower() == "cpu"
    if not force_cpu and n >= max(min_ranks, 1):
        model = gpu_model or ("small" if n < 8 else "base")
        for ranks in range(min(n, max_ranks), max(min_ranks, 1) - 1, -1):
            if fits is None or fits(ranks, model) is None:
                return LabSize("multi-gpu" if n > 1 else "gpu", "cuda", ranks, "nccl", model,
                               gpu_steps, n, cores)
    return LabSize("cpu", "cpu", min_ranks, "gloo", cpu_model, cpu_steps, n, cores)


# What each lab asks of :func:`lab_size`: its rank range, presets meeting its constraints, demo
# length. One table, read by the labs (``lab_size_for``) and by ``llmlab doctor``.
LAB_SIZES: dict[str, dict] = {
    "00_three_walls": dict(max_ranks=8, min_ranks=2, cpu_steps=10, gpu_steps=50),
    "01_data_parallel": dict(max_ranks=8, min_ranks=2, cpu_steps=4, gpu_steps=20),
    # tp <= 4 divides the 8 heads / 4 kv heads of "small"
    "02_tensor_parallel": dict(max_ranks=4, min_ranks=2, gpu_model="small", cpu_steps=8, gpu_steps=20),
    # pp <= 4 times 2 virtual stages divides the 8 layers of "small"
    "03_pipeline_parallel": dict(max_ranks=4, min_ranks=2, gpu_model="small", cpu_steps=5, gpu_steps=20),
    # an MoE preset; dp = ep ranks divide its 4 experts
    "04_expert_parallel": dict(max_ranks=4, min_ranks=2, cpu_model="tiny-moe", gpu_model="tiny-moe",
                               cpu_steps=10, gpu_steps=30),
    "05_zero": dict(max_ranks=4, min_ranks=2, cpu_steps=2, gpu_steps=5),
    # one engine process serving the shipped model
    "06_paged_kv_cache": dict(max_ranks=1, min_ranks=1, cpu_model="shakespeare", gpu_model="shakespeare"),
    "07_continuous_batching": dict(max_ranks=1, min_ranks=1, cpu_model="shakespeare",
                                   gpu_model="shakespeare"),
    "08_3d_parallelism": dict(max_ranks=8, min_ranks=4),
    "09_kernels": dict(max_ranks=1, min_ranks=1),
    # an HTTP server: engine replicas of the shipped model in one process (a GPU each where there are several)
    "11_deployment": dict(max_ranks=2, min_ranks=1, cpu_model="shakespeare", gpu_model="shakespeare"),
}


# The training layouts each lab runs with ``n`` ranks (TrainConfig fields; the notebooks build the
# same), checked by :func:`lab_layout_error` with the trainer's own validation. Labs 00, 06, 07
# and 09 train no multi-rank layout; lab 08's layouts use 4 ranks, and 8 from 8 GPUs.
def _ep(n: int) -> int:  # lab 04: the largest expert-parallel degree dividing the 4 experts
    return max(d for d in (1, 2, 4, 8) if d <= n and 4 % d == 0)


LAB_LAYOUTS: dict[str, Callable[[int], list[dict]]] = {
    "01_data_parallel": lambda n: [
        dict(dp=n, dp_mode=mode, num_microbatches=m, global_batch_size=8 * n, seq_len=64)
        for mode, m in (("naive", 1), ("ddp", 1), ("ddp", 2))] + [
        dict(dp=k, global_batch_size=8 * n, seq_len=64) for k in (1, 2, 4, 8) if k <= n],
    "02_tensor_parallel": lambda n: [dict(tp=n, sequence_parallel=sp, global_batch_size=4, seq_len=32)
                                     for sp in (False, True)],
    "03_pipeline_parallel": lambda n: [
        dict(pp=n, pp_schedule=s, virtual_stages=v, global_batch_size=16, seq_len=64,
             num_microbatches=8) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))] + [
        dict(pp=n, pp_schedule=s, num_microbatches=m, global_batch_size=2 * m, seq_len=64)
        for s in ("gpipe", "1f1b") for m in (1, 2, 4, 8)],
    "04_expert_parallel": lambda n: [dict(dp=_ep(n), ep=_ep(n))],
    "05_zero": lambda n: [dict(dp=n, zero=stage, dtype=dt) for stage in (1, 2, 3)
                          for dt in ("fp32", "bf16")],
    "08_3d_parallelism": lambda n: [dict(global_batch_size=8, seq_len=32, **lay) for lay in (
        [dict(dp=4), dict(dp=2, tp=2), dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2),
         dict(dp=2, pp=2, num_microbatches=2), dict(dp=2, zero=1), dict(tp=4)]
        + ([dict(dp=2, tp=2, pp=2, num_microbatches=2)] if n >= 8 else []))],
}


_layout_validator: Callable[[dict], None] | None = None


def register_layout_validator(fn: Callable[[dict], None]) -> None:
    """Set the check applied to each lab layout: ``fn(TrainConfig fields)`` raises ``ValueError``
    naming the broken constraint. :mod:`llmlab.training.config` registers the trainer's own
    ``validate`` when imported (``import llmlab`` does), so this bottom layer never imports the
    trainer."""
    global _layout_validator
    _layout_validator = fn


def lab_layout_error(lab: str, ranks: int, model: str) -> str | None:
    """``None`` if every layout lab ``lab`` trains with ``ranks`` ranks and preset ``model`` passes
    the trainer's validation (tp dividing the heads, pp the layers, dp the batch, ...), else the
    first refusal, prefixed with the layout. Raises ``RuntimeError`` if no validator is registered
    (:mod:`llmlab.training.config` not imported)."""
    if _layout_validator is None:
        raise RuntimeError("no layout validator registered: import llmlab (llmlab.training.config "
                           "registers the trainer's validate)")
    for kw in LAB_LAYOUTS.get(lab, lambda n: [])(ranks):
        try:
            _layout_validator(dict(model=model, **kw))
        except (ValueError, NotImplementedError) as e:
            return f"{kw}: {e}"
    return None


def lab_size_for(lab: str, force_cpu: bool | None = None) -> LabSize:
    """The size lab ``lab`` (a notebook name such as ``"03_pipeline_parallel"``) runs at here:
    :func:`lab_size` with that lab's entry of :data:`LAB_SIZES`, at the largest rank count whose
    layouts validate (:func:`lab_layout_error`). Raises ``KeyError`` naming the labs if ``lab``
    is not one."""
    if lab not in LAB_SIZES:
        raise KeyError(f"no lab named {lab!r}; labs: {', '.join(LAB_SIZES)}")
    return lab_size(force_cpu=force_cpu, fits=lambda n, model: lab_layout_error(lab, n, model),
                    **LAB_SIZES[lab])
