"""A vLLM-style inference engine that runs on CPU and GPU.

Paged KV cache with a ref-counted block pool, prefix caching and copy-on-write
(:mod:`~llmlab.inference.block_manager`, Kwon et al., SOSP 2023), iteration-level scheduling with
chunked prefill and preemption (:mod:`~llmlab.inference.scheduler`, Orca, Yu et al., OSDI 2022),
PagedAttention in PyTorch (:mod:`~llmlab.inference.paged_attention`; on CUDA the Triton kernel
of :mod:`llmlab.kernels.paged_attention`) called by the model's own forward through the step's
attention context (:mod:`~llmlab.inference.model_runner`), the engine step
(:mod:`~llmlab.inference.engine`) and its settings (:mod:`~llmlab.inference.engine_config`), its outputs (:mod:`~llmlab.inference.outputs`) and the ``LLM``
API (:mod:`~llmlab.inference.llm`). ``llmlab generate`` is :mod:`~llmlab.inference.cli`.
"""

from llmlab.inference.block_manager import BlockManager
from llmlab.inference.engine import LLMEngine
from llmlab.inference.engine_config import EngineConfig
from llmlab.inference.llm import LLM
from llmlab.inference.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepMetrics
from llmlab.inference.sampling import SamplingParams
from llmlab.inference.scheduler import Scheduler, SchedulerConfig
from llmlab.inference.sequence import Sequence, SequenceStatus

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "StepMetrics",
    "BlockManager",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
]
