"""What the strategies record on the parameters and the model they shard: one typed record each.

A strategy that shards a model leaves notes for the ones that run after it (data parallelism, ZeRO,
the global gradient norm); they are kept in one record per parameter and one per model instead of
ad-hoc attributes:

* :class:`ParamRecord` (``param_record(p)``): ``tp_duplicate`` (another tensor-parallel rank holds
  the same values: the gradient norm counts them once), ``expert_parallel`` (an expert's parameter,
  reduced over the expert-data-parallel group ``edp`` instead of ``dp``), ``sequence_parallel`` (a
  partial gradient under sequence parallelism, summed over the tp group after backward);
* :class:`ModelRecord` (``model_record(model)``): ``grad_finalizers``, the callables the trainer
  runs after gradient synchronisation, each as ``f(grad_of)`` (``grad_of(p)``: the gradient of
  ``p`` this rank holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from torch import Tensor, nn

_ATTR = "llmlab_record"
R = TypeVar("R", "ParamRecord", "ModelRecord")


@dataclass
class ParamRecord:
    """What the strategies say about one parameter (see the module docstring)."""

    tp_duplicate: bool = False
    expert_parallel: bool = False
    sequence_parallel: bool = False


@dataclass
class ModelRecord:
    """What the strategies left on a model for the trainer (see the module docstring)."""

    grad_finalizers: list[Callable[..., Any]] = field(default_factory=list)


def _record(obj: Any, make: Callable[[], R]) -> R:
    rec = getattr(obj, _ATTR, None)
    if rec is None:
        rec = make()
        setattr(obj, _ATTR, rec)
    return rec


def param_record(p: Tensor) -> ParamRecord:
    """``p``'s record (a model parameter's), made (all ``False``) on first use."""
    return _record(p, ParamRecord)


def model_record(model: nn.Module) -> ModelRecord:
    """``model``'s record, made (no finalizers) on first use."""
    return _record(model, ModelRecord)
