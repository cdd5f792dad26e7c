"""What each strategy is told: one small, frozen dataclass per strategy.

A strategy in :mod:`llmlab.parallel` never reads the trainer's configuration; the trainer's
:mod:`llmlab.training.config` builds these from ``TrainConfig`` once per rank
(``llmlab.training.config.strategy_configs``), and a test or a tool may build them by hand. Each
one carries its strategy's own knobs, named as the strategy names them (a pipeline's ``schedule``,
ZeRO's ``stage``); the degrees of the layout (``dp``, ``tp``, ``pp``, ``ep``, ``cp``) are the
mesh's (:class:`~llmlab.runtime.mesh.Mesh`), which every strategy's ``validate(config, mesh,
model_config)`` and ``apply(model, mesh, config)`` receive beside its config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelConfig:
    """Data parallelism (:mod:`llmlab.parallel.data_parallel`): replicas synchronising gradients
    by ``mode`` (naive, ddp, ring) in buckets of ``bucket_mb`` MiB; the global batch of
    ``global_batch_size`` sequences is split over the ``dp`` replicas, each rank's share into
    ``num_microbatches`` micro-batches (gradient accumulation)."""

    mode: str = "ddp"
    bucket_mb: float = 25.0
    global_batch_size: int = 1
    num_microbatches: int = 1


@dataclass(frozen=True)
class TensorParallelConfig:
    """Tensor (+ sequence) parallelism (:mod:`llmlab.parallel.tp_plan`): with
    ``sequence_parallel`` the activations between regions are split along the sequence of
    ``seq_len`` tokens."""

    sequence_parallel: bool = False
    seq_len: int | None = None


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism (:mod:`llmlab.parallel.pipeline_parallel`): each rank holds
    ``virtual_stages`` chunks (interleaved schedule only), ``num_microbatches`` per flush of
    sequences of ``seq_len`` tokens (this rank's: ``seq_len/cp`` under context parallelism);
    under sequence parallelism the activations sent between stages are ``seq_len/tp`` long."""

    schedule: str = "1f1b"
    virtual_stages: int = 1
    num_microbatches: int = 1
    seq_len: int = 64
    sequence_parallel: bool = False

    @property
    def num_chunks(self) -> int:
        """Model chunks per rank: ``virtual_stages`` for the interleaved schedule, else 1."""
        return self.virtual_stages if self.schedule == "interleaved" else 1


@dataclass(frozen=True)
class ExpertParallelConfig:
    """Expert parallelism (:mod:`llmlab.parallel.expert_parallel`): no knob beyond its degree,
    the mesh's ``ep`` (ranks sharing the experts, carved out of the ``dp`` data-parallel ranks)."""


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO (:mod:`llmlab.parallel.zero`): ``stage`` 0 (off), 1, 2 or 3 over the data-parallel
    ranks, compute ``dtype`` (fp32, bf16, fp16) of the flat buffers, ``bucket_mb`` MiB per bucket,
    ``cpu_offload`` of the masters and moments; ``full_model_saved``: the run writes the whole
    model at its end (which stage 3's shards cannot do yet)."""

    stage: int = 0
    dtype: str = "fp32"
    bucket_mb: float = 25.0
    cpu_offload: bool = False
    full_model_saved: bool = False


@dataclass(frozen=True)
class ContextParallelConfig:
    """Context parallelism (:mod:`llmlab.parallel.context_parallel`): the ``cp`` ranks of the mesh
    split each sequence of ``seq_len`` tokens, attention by ``mode`` (ring, ulysses);
    ``sequence_parallel`` of the layout constrains it."""

    mode: str = "ring"
    seq_len: int = 64
    sequence_parallel: bool = False
