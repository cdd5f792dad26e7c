"""Mixed precision: 16-bit compute with fp32 master weights, and dynamic loss scaling for fp16.

Micikevicius et al. 2018, "Mixed Precision Training", §3: keep an fp32 master copy of the
weights for the update (small updates vanish when added to a 16-bit weight), compute forward and
backward in 16 bits, and for fp16 scale the loss so small gradients do not underflow. bf16 has
fp32's exponent range, so it needs no loss scaling (Kalamkar et al. 2019).

Per parameter this costs 2 (16-bit weight) + 2 (16-bit gradient) + 4 (fp32 master) + 8 (Adam m, v)
= 16 bytes: the ZeRO paper's 2Ψ + 2Ψ + 12Ψ (Rajbhandari et al. 2020, §3.1).
"""

from __future__ import annotations

import math

import torch

from llmlab.parallel.protocols import ParamStateLookup, load_replica_param_state, replica_param_state

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DynamicLossScaler:
    """Scale the loss by ``scale``; on an overflow (inf/nan gradient) skip the step and halve it,
    after ``growth_interval`` clean steps double it (Micikevicius et al. 2018, §3.2)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 1000,
        backoff: float = 0.5,
        growth: float = 2.0,
        min_scale: float = 1.0,
    ):
        self.scale, self.growth_interval = init_scale, growth_interval
        self.backoff, self.growth, self.min_scale = backoff, growth, min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.clean_steps = float(sd["scale"]), int(sd["clean_steps"])
        self.skipped_steps = int(sd.get("skipped_steps", 0))

    def update(self, found_overflow: bool) -> None:
        if found_overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.clean_steps = 0
            self.skipped_steps += 1
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= self.growth


class MixedPrecisionOptimizer:
    """Wrap an optimizer so it updates fp32 master copies of 16-bit model parameters.

    ``params``: the model's 16-bit parameters (their ``.grad`` is filled by backward).
    ``make_optimizer(master_params)`` builds the inner optimizer over the fp32 masters.
    ``step()`` copies the 16-bit gradients into fp32 (unscaled when a ``scaler`` is given), steps
    the inner optimizer, and writes the masters back into the model in 16 bits; on overflow it
    skips the update. That is one process's decision: the trainer calls :meth:`unscale` and
    :meth:`apply` itself around one overflow decision for the whole job
    (:func:`llmlab.training.grad_norm.global_grad_norm`).
    ``state`` is the inner optimizer's plus the masters, so
    :func:`llmlab.metrics.memory.optimizer_state_bytes` counts 12 bytes per parameter for Adam.
    """

    def __init__(self, params, make_optimizer, scaler: DynamicLossScaler | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = make_optimizer(self.master)
        self.scaler = scaler
        self.last_step_skipped = False

    @property
    def state(self):
        st = dict(self.optimizer.state)
        for m in self.master:
            st.setdefault(m, {})
            st[m] = dict(st[m]) | {"master_weight": m}
        return st

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    @torch.no_grad()
    def unscale(self) -> None:
        """Copy the 16-bit gradients into the fp32 masters' ``.grad``, divided by the loss scale."""
        inv = 1.0 / self.loss_scale()
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float() * inv

    def grad_pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(fp32 unscaled gradient, model parameter)`` pairs, after :meth:`unscale`."""
        return [(m.grad, p) for p, m in zip(self.params, self.master) if m.grad is not None]

    @torch.no_grad()
    def apply(self) -> None:
        """Step the inner optimizer on the masters and write them back in 16 bits."""
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m.to(p.dtype))

    @torch.no_grad()
    def step(self) -> bool:
        """Unscale, check this process's gradients for overflow, update.

        Returns ``True`` if the update was applied, ``False`` if skipped (overflow).
        """
        self.unscale()
        if self.scaler is not None:
            overflow = not all(bool(torch.isfinite(m.grad).all()) for m in self.master if m.grad is not None)
            self.scaler.update(overflow)
            if overflow:
                self.last_step_skipped = True
                return False
        self.apply()
        self.last_step_skipped = False
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def param_state(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's weights, fp32 master and Adam state, whole, on the CPU
        (:class:`~llmlab.parallel.protocols.TrainerOptimizer`)."""
        return replica_param_state(list(zip(self.params, self.master)), self.optimizer)

    def load_param_state(self, lookup: ParamStateLookup) -> None:
        """Install the weights (into the parameters and the masters) and Adam state ``lookup``
        gives for each parameter."""
        load_replica_param_state(list(zip(self.params, self.master)), self.optimizer, lookup)


def cast_model(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """Cast floating parameters and buffers to ``dtype`` (``fp32``/``bf16``/``fp16``).

    Raises ``ValueError`` for an unknown dtype name.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return model.to(DTYPES[dtype])


def relative_gap(a: list[float], b: list[float]) -> float:
    """Largest relative difference between two loss curves (for tolerance statements)."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) if a else math.nan
