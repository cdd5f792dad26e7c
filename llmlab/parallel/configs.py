"""What each strategy is told: one small, frozen dataclass per strategy.

A strategy in :mod:`llmlab.parallel` never reads the trainer's configuration; the trainer's
:mod:`llmlab.training.config` builds these from ``TrainConfig`` (``llmlab.training.config.
strategy_configs``), and a test or a tool may build them by hand. Each one carries the degrees and
sizes its strategy's checks and wrapper read, named as the strategy names them (a pipeline's
``schedule``, ZeRO's ``stage``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelConfig:
    """Data parallelism (:mod:`llmlab.parallel.data_parallel`): ``dp`` replicas synchronising
    gradients by ``mode`` (naive, ddp, ring) in buckets of ``bucket_mb`` MiB; the global batch
    (sequences per step) is split over them."""

    dp: int = 1
    mode: str = "ddp"
    bucket_mb: float = 25.0
    global_batch_size: int = 1


@dataclass(frozen=True)
class TensorParallelConfig:
    """Tensor (+ sequence) parallelism (:mod:`llmlab.parallel.tensor_parallel`): ``tp`` ranks per
    layer; with ``sequence_parallel`` the activations between regions are split along the
    sequence of ``seq_len`` tokens."""

    tp: int = 1
    sequence_parallel: bool = False
    seq_len: int | None = None


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism (:mod:`llmlab.parallel.pipeline_parallel`): ``pp`` stages, each rank
    ``virtual_stages`` chunks (interleaved schedule only), ``num_microbatches`` per flush of
    sequences of ``seq_len`` tokens (this rank's, under context parallelism); under sequence
    parallelism (``tp`` > 1) the activations sent between stages are ``seq_len/tp`` long."""

    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    num_microbatches: int = 1
    seq_len: int = 64
    tp: int = 1
    sequence_parallel: bool = False

    @property
    def num_chunks(self) -> int:
        """Model chunks per rank: ``virtual_stages`` for the interleaved schedule, else 1."""
        return self.virtual_stages if self.schedule == "interleaved" else 1


@dataclass(frozen=True)
class ExpertParallelConfig:
    """Expert parallelism (:mod:`llmlab.parallel.expert_parallel`): ``ep`` ranks share the experts,
    carved out of ``dp`` data-parallel ranks; ``tp``/``sequence_parallel`` of the layout."""

    ep: int = 1
    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False


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
    """Context parallelism (:mod:`llmlab.parallel.context_parallel`): ``cp`` ranks split each
    sequence of ``seq_len`` tokens, attention by ``mode`` (ring, ulysses); ``tp``,
    ``sequence_parallel`` and ``ep`` of the layout, which constrain it."""

    cp: int = 1
    mode: str = "ring"
    seq_len: int = 64
    tp: int = 1
    sequence_parallel: bool = False
    ep: int = 1
