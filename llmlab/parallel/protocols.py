"""What the trainer calls on the module it trains, whichever strategy wraps it.

:class:`TrainedModule` is the one interface of the data-parallel wrappers
(:mod:`llmlab.parallel.data_parallel`), ZeRO's (:class:`~llmlab.parallel.zero.ZeroDataParallel`)
and the trainer's one-replica ``LocalModule``: the trainer calls it without asking what it is.
"""
from __future__ import annotations

from typing import ContextManager, Protocol

import torch
from torch import nn


class TrainedModule(Protocol):
    """A model replica (``module``) with its gradient synchronisation.

    ``__call__(input_ids, labels)``: the loss; ``no_sync()``: backward inside it accumulates
    without communication (all micro-batches but the last); ``finish_grad_sync()``: wait until
    every gradient is reduced (once per step, before the optimizer); ``grad_of(p)``: the gradient
    of ``p`` this rank holds after that (``p.grad``; under ZeRO the part of ``p`` in this rank's
    shard; ``None`` when it holds none); ``grad_tensors()``: every gradient tensor this rank holds
    (for its memory, in bytes).
    """

    module: nn.Module

    def __call__(self, *args, **kwargs) -> torch.Tensor: ...

    def no_sync(self) -> ContextManager: ...

    def finish_grad_sync(self) -> None: ...

    def grad_of(self, p: nn.Parameter) -> torch.Tensor | None: ...

    def grad_tensors(self) -> list[torch.Tensor]: ...


def replica_grads(module: nn.Module) -> list[torch.Tensor]:
    """``grad_tensors()`` of a wrapper whose gradients are the parameters' own ``.grad``."""
    return [p.grad for p in module.parameters() if p.grad is not None]


class TrainerOptimizer(Protocol):
    """The optimizer the trainer steps: fp32 (the trainer's ``FP32Optimizer``), mixed precision
    (:class:`~llmlab.training.precision.MixedPrecisionOptimizer`) or ZeRO's
    (:class:`~llmlab.parallel.zero_optimizer.ZeroOptimizer`).

    ``unscale()``: the gradients it will use, fp32 and divided by the fp16 loss scale;
    ``grad_pieces()``: then ``(gradient, model parameter)`` for every element this rank holds;
    ``apply()``: the update (with the learning rate set in ``param_groups``); ``zero_grad()``.
    """

    param_groups: list

    def unscale(self) -> None: ...

    def grad_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter]]: ...

    def apply(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...
