"""The size each lab runs at on this machine: one table for every notebook and ``llmlab doctor``.

:func:`llmlab.runtime.hardware.lab_size` knows the hardware; this module knows the labs: each
lab's rank range, presets and demo length (:data:`LAB_SIZES`), and the training layouts it runs
(:data:`LAB_LAYOUTS`), checked with the trainer's own validation so that a machine with, say, 3
GPUs gives a layout that divides the model (tp = 2 on 8 heads, not 3). It sits above
``training`` (it imports its validation), beside ``doctor`` and the CLI.
"""

from __future__ import annotations

from typing import Callable

from llmlab.runtime.hardware import LabSize, lab_size
from llmlab.training.config import TrainConfig, validate


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
    "04_expert_parallel": dict(
        max_ranks=4, min_ranks=2, cpu_model="tiny-moe", gpu_model="tiny-moe", cpu_steps=10, gpu_steps=30
    ),
    "05_zero": dict(max_ranks=4, min_ranks=2, cpu_steps=2, gpu_steps=5),
    # one engine process serving the shipped model
    "06_paged_kv_cache": dict(max_ranks=1, min_ranks=1, cpu_model="shakespeare", gpu_model="shakespeare"),
    "07_continuous_batching": dict(
        max_ranks=1, min_ranks=1, cpu_model="shakespeare", gpu_model="shakespeare"
    ),
    "08_3d_parallelism": dict(max_ranks=8, min_ranks=4, cpu_steps=5, gpu_steps=5),  # every run of the lab
    "09_kernels": dict(max_ranks=1, min_ranks=1),
    # cp ranks split the sequence (2 on CPU); ulysses needs cp | the kv heads of "small" (4)
    "10_context_parallel": dict(max_ranks=4, min_ranks=2, gpu_model="small", cpu_steps=2, gpu_steps=10),
    # an HTTP server: engine replicas of the shipped model in one process (a GPU each where there are several)
    "11_deployment": dict(max_ranks=2, min_ranks=1, cpu_model="shakespeare", gpu_model="shakespeare"),
    # the planner validated in miniature: its layouts come from the search, checked by the trainer
    "12_planner": dict(max_ranks=4, min_ranks=2, cpu_steps=4, gpu_steps=6),
    # two hosts on this machine with 2 ranks each (dp2 x tp2); they share its GPUs, so the lab
    # runs them as CPU ranks (LLMLAB_DEVICE=cpu): on real nodes the same commands use NCCL
    "13_cluster": dict(max_ranks=4, min_ranks=4, cpu_steps=6, gpu_steps=6),
    # one engine process (a small random Qwen2.5-VL) and the HTTP server on a thread
    "14_images": dict(max_ranks=1, min_ranks=1),
    # one training rank (LoRA on SmolLM2-135M-Instruct, llmlab.model.packaged), then one server
    "15_finetune_and_serve": dict(max_ranks=1, min_ranks=1, cpu_steps=10, gpu_steps=10),
}


# The training layouts each lab runs with ``n`` ranks (TrainConfig fields; the notebooks build the
# same), checked by :func:`lab_layout_error` with the trainer's own validation. Labs 00, 06, 07
# and 09 train no multi-rank layout; lab 08's layouts use 4 ranks, and 8 from 8 GPUs.
def _ep(n: int) -> int:  # lab 04: the largest expert-parallel degree dividing the 4 experts
    return max(d for d in (1, 2, 4, 8) if d <= n and 4 % d == 0)


LAB_LAYOUTS: dict[str, Callable[[int], list[dict]]] = {
    "01_data_parallel": lambda n: (
        [
            dict(dp=n, dp_mode=mode, num_microbatches=m, global_batch_size=8 * n, seq_len=64)
            for mode, m in (("naive", 1), ("ddp", 1), ("ddp", 2))
        ]
        + [dict(dp=k, global_batch_size=8 * n, seq_len=64) for k in (1, 2, 4, 8) if k <= n]
    ),
    "02_tensor_parallel": lambda n: [
        dict(tp=n, sequence_parallel=sp, global_batch_size=4, seq_len=32) for sp in (False, True)
    ],
    "03_pipeline_parallel": lambda n: (
        [
            dict(pp=n, pp_schedule=s, virtual_stages=v, global_batch_size=16, seq_len=64, num_microbatches=8)
            for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
        ]
        + [
            dict(pp=n, pp_schedule=s, num_microbatches=m, global_batch_size=2 * m, seq_len=64)
            for s in ("gpipe", "1f1b")
            for m in (1, 2, 4, 8)
        ]
        + [
            dict(
                pp=n,
                pp_schedule=s,
                virtual_stages=v,
                num_microbatches=n,
                global_batch_size=2 * n,
                seq_len=256,
            )
            for s, v in (("1f1b", 1), ("interleaved", 2))
        ]
    ),
    "04_expert_parallel": lambda n: [dict(dp=_ep(n), ep=_ep(n))],
    "05_zero": lambda n: [dict(dp=n, zero=stage, dtype=dt) for stage in (1, 2, 3) for dt in ("fp32", "bf16")],
    "08_3d_parallelism": lambda n: [
        dict(global_batch_size=8, seq_len=32, **lay)
        for lay in (
            [
                dict(dp=4),
                dict(dp=2, tp=2),
                dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2),
                dict(dp=2, pp=2, num_microbatches=2),
                dict(dp=2, zero=1),
                dict(tp=4),
            ]
            + ([dict(dp=2, tp=2, pp=2, num_microbatches=2)] if n >= 8 else [])
        )
    ],
    "10_context_parallel": lambda n: [
        dict(cp=n, cp_mode=mode, seq_len=S, global_batch_size=B)
        for mode in ("ring", "ulysses")
        for S, B in ((128, 2), (1024, 2), (256, 4))
    ],
}


def lab_layout_error(lab: str, ranks: int, model: str) -> str | None:
    """``None`` if every layout lab ``lab`` trains with ``ranks`` ranks and preset ``model`` passes
    :func:`llmlab.training.config.validate` (tp dividing the heads, pp the layers, dp the batch,
    ...), else the first refusal, prefixed with the layout."""
    for kw in LAB_LAYOUTS.get(lab, lambda n: [])(ranks):
        try:
            validate(TrainConfig(model=model, device="cpu", **kw))
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
    return lab_size(
        force_cpu=force_cpu, fits=lambda n, model: lab_layout_error(lab, n, model), **LAB_SIZES[lab]
    )
