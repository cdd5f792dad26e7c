"""The contracts between the strategies and the trainer: what each side calls on the other.

* :class:`Strategy`: what every strategy module offers (``validate``, ``apply``);
* :class:`TrainedModule`: the one interface of the data-parallel wrappers
  (:mod:`llmlab.parallel.data_parallel`), ZeRO's (:class:`~llmlab.parallel.zero.ZeroDataParallel`)
  and the trainer's one-replica ``LocalModule``: the trainer calls it without asking what it is;
* :class:`TrainerOptimizer`: the optimizer the trainer steps and the checkpoint saves, whatever
  shards its states (whole tensors in and out: ``param_state``, ``load_param_state``).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol

import torch
from torch import nn

from llmlab.model.config import ModelConfig
from llmlab.runtime.mesh import Mesh


class Strategy(Protocol):
    """The contract every strategy module of :mod:`llmlab.parallel` offers (data parallelism,
    tensor + sequence parallelism in ``tp_plan``, pipeline, expert, ZeRO, context parallelism):

    * ``validate(config, mesh, model_config)``: before any rank starts, raise ``ValueError``
      (or ``NotImplementedError``) naming the constraint and the flag; the one home of each of
      its layout rules. ``config``: its dataclass in :mod:`llmlab.parallel.configs`; ``mesh``:
      the layout's degrees (a :class:`~llmlab.runtime.mesh.Mesh`, process groups not needed);
    * ``apply(model, mesh, config)``: on each rank, this rank's part of ``model`` (sharded,
      split or wrapped), ``model`` itself when the strategy's degree is 1. ZeRO's also takes the
      optimizer factory and returns ``(wrapper, optimizer)``: it shards the optimizer's states;
    * where it shards state, whole tensors through the optimizer's ``param_state`` /
      ``load_param_state`` (:class:`TrainerOptimizer`), so checkpoints never see the shards.
    """

    def validate(self, config: Any, mesh: Mesh, model_config: ModelConfig, /) -> None: ...


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

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...

    def no_sync(self) -> ContextManager[Any]: ...

    def finish_grad_sync(self) -> None: ...

    def grad_of(self, p: nn.Parameter) -> torch.Tensor | None: ...

    def grad_tensors(self) -> list[torch.Tensor]: ...


def replica_grads(module: nn.Module) -> list[torch.Tensor]:
    """``grad_tensors()`` of a wrapper whose gradients are the parameters' own ``.grad``."""
    return [p.grad for p in module.parameters() if p.grad is not None]


#: A lookup the checkpoint hands to ``load_param_state``: for a model parameter this rank holds,
#: its whole (tensor-parallel-local) fp32 tensors to install: ``"param"`` (the weights) and any
#: optimizer state saved with it (``"exp_avg"``, ``"exp_avg_sq"``, ``"step"``).
ParamStateLookup = Callable[[nn.Parameter], dict[str, torch.Tensor]]


class TrainerOptimizer(Protocol):
    """The optimizer the trainer steps: fp32 (the trainer's ``FP32Optimizer``), mixed precision
    (:class:`~llmlab.training.precision.MixedPrecisionOptimizer`) or ZeRO's
    (:class:`~llmlab.parallel.zero_optimizer.ZeroOptimizer`).

    ``unscale()``: the gradients it will use, fp32 and divided by the fp16 loss scale;
    ``grad_pieces()``: then ``(gradient, model parameter)`` for every element this rank holds;
    ``apply()``: the update (with the learning rate set in ``param_groups``); ``zero_grad()``.

    The checkpoint's pair, whatever shards the states: ``param_state()`` gives, for every model
    parameter this rank holds, its whole (tensor-parallel-local) tensors on the CPU: ``"param"``
    (the weights, in the model's dtype), ``"master"`` (the fp32 master, where it is a separate
    tensor) and the optimizer's state (Adam ``"exp_avg"``, ``"exp_avg_sq"``, ``"step"``);
    ``load_param_state(lookup)`` installs them (:data:`ParamStateLookup`). Under ZeRO both are
    collective over the data-parallel group (the shards are gathered or cut).
    """

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def unscale(self) -> None: ...

    def grad_pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def apply(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def param_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]: ...

    def load_param_state(self, lookup: ParamStateLookup) -> None: ...


def replica_param_state(
    pairs: list[tuple[nn.Parameter, torch.Tensor]], optimizer: torch.optim.Optimizer
) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
    """``param_state()`` of an optimizer that holds whole tensors: ``pairs`` of (model parameter,
    the tensor ``optimizer`` updates: the parameter itself, or its fp32 master)."""
    out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    for p, target in pairs:
        st = {"param": p.detach().to("cpu").clone()}
        if target is not p:
            st["master"] = target.detach().to("cpu").clone()
        for k, v in optimizer.state.get(target, {}).items():
            if isinstance(v, torch.Tensor):
                st[k] = v.detach().to("cpu").clone()
        out[p] = st
    return out


@torch.no_grad()
def load_replica_param_state(
    pairs: list[tuple[nn.Parameter, torch.Tensor]], optimizer: torch.optim.Optimizer, lookup: ParamStateLookup
) -> None:
    """``load_param_state(lookup)`` of an optimizer that holds whole tensors (see
    :func:`replica_param_state`): weights into the parameter and its master, the moments on the
    master's device, Adam's ``step`` kept on the CPU (as torch does unless capturable)."""
    for p, target in pairs:
        st = dict(lookup(p))
        weights = st.pop("param")
        p.copy_(weights.to(p.dtype))
        if target is not p:
            target.copy_(weights.to(target.dtype))
        state = {k: v.clone() if v.dim() == 0 else v.clone().to(target.device) for k, v in st.items()}
        if state:
            optimizer.state[target] = state
