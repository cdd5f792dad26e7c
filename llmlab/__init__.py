"""llmlab: how large language models are trained and served at scale, by running the real thing.

Top-level names::

    llmlab.launch(fn, world_size, *args, backend="auto")   # run fn on N real ranks
    llmlab.Mesh, llmlab.ModelConfig, llmlab.get_preset, llmlab.LlamaForCausalLM
    llmlab.TrainConfig, llmlab.train                       # what `llmlab train` runs
    llmlab.inference.LLM, llmlab.inference.SamplingParams  # offline generation

Strategy wrappers live in :mod:`llmlab.parallel` (one file per strategy).
"""
from llmlab.model.config import PRESETS, ModelConfig, get_preset
from llmlab.model.llama import LlamaForCausalLM
from llmlab.runtime.launch import RankError, launch, report
from llmlab.runtime.mesh import Mesh
from llmlab.runtime.result_auth import ForgedValueError
from llmlab.training.config import TrainConfig
from llmlab.training.trainer import train
from llmlab.planner.api import plan  # noqa: E402  (llmlab.plan(...): the layout planner)
from llmlab import inference  # noqa: E402  (llmlab.inference.LLM / SamplingParams)

__version__ = "0.1.0"

__all__ = ["plan", "launch", "report", "RankError", "ForgedValueError", "Mesh", "ModelConfig", "PRESETS", "get_preset",
           "LlamaForCausalLM", "TrainConfig", "train", "inference", "__version__"]
