"""What this machine offers, and the size a lab runs at here.

Labs call :func:`lab_size` at the top, so the same notebook runs unchanged on a CPU laptop (several
gloo processes, the tiny model), one GPU, or a node of several GPUs (one rank per GPU, NCCL, a
bigger model), and shows the chosen size.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

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
             gpu_steps: int = 200) -> LabSize:
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
    """
    cores = os.cpu_count() or 1
    n = gpu_count()
    if force_cpu is None:
        force_cpu = os.environ.get("LLMLAB_DEVICE", "").lower() == "cpu"
    if not force_cpu and n >= max(min_ranks, 1):
        ranks = min(n, max_ranks)
        model = gpu_model or ("small" if n < 8 else "base")
        return LabSize("multi-gpu" if n > 1 else "gpu", "cuda", ranks, "nccl", model, gpu_steps,
                       n, cores)
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
    # cp ranks split the sequence (2 on CPU); ulysses needs cp | the kv heads of "small" (4)
    "10_context_parallel": dict(max_ranks=4, min_ranks=2, gpu_model="small", cpu_steps=2, gpu_steps=10),
}


def lab_size_for(lab: str, force_cpu: bool | None = None) -> LabSize:
    """The size lab ``lab`` (a notebook name such as ``"03_pipeline_parallel"``) runs at here:
    :func:`lab_size` with that lab's entry of :data:`LAB_SIZES`. Raises ``KeyError`` naming the
    labs if ``lab`` is not one."""
    if lab not in LAB_SIZES:
        raise KeyError(f"no lab named {lab!r}; labs: {', '.join(LAB_SIZES)}")
    return lab_size(force_cpu=force_cpu, **LAB_SIZES[lab])
