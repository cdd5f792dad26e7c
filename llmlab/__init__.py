"""llmlab: how large language models are trained and served at scale, by running the real thing.

Top-level names::

    llmlab.launch(fn, world_size, *args, backend="auto")   # run fn on N real ranks
    llmlab.Mesh, llmlab.ModelConfig, llmlab.get_preset, llmlab.LlamaForCausalLM
    llmlab.TrainConfig, llmlab.train                       # what `llmlab train` runs
    llmlab.inference.LLM, llmlab.inference.SamplingParams  # offline generation
    llmlab.plan(...)                                       # rank DP x TP x PP x CP layouts (`llmlab plan`)
    llmlab.plan(..., serve=True), llmlab.plan_serve(...)  # serving layouts (`llmlab plan --serve`)

Strategy wrappers live in :mod:`llmlab.parallel` (one file per strategy).
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# name -> the module it comes from, imported on first use (PEP 562), so that ``import llmlab``,
# ``llmlab --version`` and ``llmlab --help`` do not import torch (about 2 s).
_LAZY = {
    "PRESETS": "llmlab.model.config",
    "ModelConfig": "llmlab.model.config",
    "get_preset": "llmlab.model.config",
    "LlamaForCausalLM": "llmlab.model.llama",
    "RankError": "llmlab.runtime.launch",
    "launch": "llmlab.runtime.launch",
    "report": "llmlab.runtime.launch",
    "Mesh": "llmlab.runtime.mesh",
    "ForgedValueError": "llmlab.runtime.result_auth",
    "TrainConfig": "llmlab.training.config",
    "train": "llmlab.training.trainer",
    "plan": "llmlab.planner.api",
    "plan_serve": "llmlab.planner.serve_api",
}

__all__ = [
    "plan",
    "plan_serve",
    "launch",
    "report",
    "RankError",
    "ForgedValueError",
    "Mesh",
    "ModelConfig",
    "PRESETS",
    "get_preset",
    "LlamaForCausalLM",
    "TrainConfig",
    "train",
    "inference",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif importlib.util.find_spec(f"llmlab.{name}") is not None:  # llmlab.inference.LLM, ...
        value = importlib.import_module(f"llmlab.{name}")
    else:
        raise AttributeError(f"module 'llmlab' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
