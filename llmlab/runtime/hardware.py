"""What this machine offers (its inventory, :func:`hardware`), and the size a lab runs at here.

Labs call :func:`lab_size` at the top, so the same notebook runs unchanged on a CPU laptop (several
gloo processes, the tiny model), one GPU, or a node of several GPUs (one rank per GPU, NCCL, a
bigger model), and shows the chosen size.
"""

from __future__ import annotations


import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Any, Callable

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
        where = (
            f"{self.num_gpus} GPU{'s' if self.num_gpus != 1 else ''}"
            if self.device == "cuda"
            else f"CPU ({self.cpu_cores} cores)"
        )
        return (
            f"lab size: {self.kind} - {self.world_size} ranks on {where}, {self.backend}, "
            f"model '{self.model}', {self.steps} steps"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity set (a learner pinned to 4 cores of a
    64-core node by the classroom's hub sees 4), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    """CUDA GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(
    device: str = "auto", ranks: int = 1, *, flag: str = "device", torchrun: bool = False
) -> str:
    """Where ``ranks`` ranks of this node (or one engine: ``ranks=1``) run: the one "auto" rule.

    ``"auto"``: ``"cuda"`` when this node has a GPU for each rank (under ``torchrun``, any GPU:
    the launcher gives each rank its own), else ``"cpu"``. ``"cpu"``, ``"cuda"`` or ``"cuda:N"``
    are checked and returned as given. Raises ``ValueError`` naming ``flag`` for another kind,
    CUDA asked for where there is none, or more ranks than visible GPUs (one GPU per rank).
    """
    device = str(device)
    n = gpu_count()
    if device == "auto":
        return "cuda" if n > 0 and (ranks <= n or torchrun) else "cpu"
    kind = device.split(":")[0]
    if kind == "cpu":
        return device
    if kind != "cuda":
        raise ValueError(f"{flag} {device!r}: expected auto, cpu or cuda")
    if n == 0:
        raise ValueError(f"{flag} {device}, but no CUDA GPU is available")
    if not torchrun and ranks > n:
        raise ValueError(f"{ranks} ranks need {ranks} GPUs, but only {n} are visible (one GPU per rank)")
    return device


def lab_size(
    max_ranks: int = 4,
    min_ranks: int = 2,
    force_cpu: bool | None = None,
    *,
    cpu_model: str = "tiny",
    gpu_model: str | None = None,
    cpu_steps: int = 20,
    gpu_steps: int = 200,
    fits: Callable[[int, str], str | None] | None = None,
) -> LabSize:
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
    cores = usable_cores()
    n = gpu_count()
    if force_cpu is None:
        force_cpu = os.environ.get("LLMLAB_DEVICE", "").lower() == "cpu"
    if not force_cpu and n >= max(min_ranks, 1):
        model = gpu_model or ("small" if n < 8 else "base")
        for ranks in range(min(n, max_ranks), max(min_ranks, 1) - 1, -1):
            if fits is None or fits(ranks, model) is None:
                return LabSize(
                    "multi-gpu" if n > 1 else "gpu", "cuda", ranks, "nccl", model, gpu_steps, n, cores
                )
    return LabSize("cpu", "cpu", min_ranks, "gloo", cpu_model, cpu_steps, n, cores)


def hardware() -> dict[str, Any]:
    """The machine's inventory: Python, platform, CPU cores, torch and its build, transformers, and
    per GPU its name, memory (bytes) and peer access; with GPUs the NCCL version and
    ``nvidia-smi topo -m`` (when that program is there). JSON-serialisable."""
    n = gpu_count()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_build": "CUDA " + torch.version.cuda if torch.version.cuda else "CPU",
        "gpus": [],
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if n:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "index": i,
                    "name": p.name,
                    "memory_bytes": p.total_memory,
                    "peer_access": [
                        j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)
                    ],
                }
            )
        if shutil.which("nvidia-smi"):
            try:
                info["topology"] = subprocess.run(
                    ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                pass
    return info
