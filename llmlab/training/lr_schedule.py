"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

The shapes of nanoGPT's ``get_lr`` and Megatron-LM's ``OptimizerParamScheduler``: the rate rises
linearly from 0 to the peak ``lr`` over ``warmup_steps`` steps, then decays to ``min_lr`` at the
last step. Steps are numbered ``1..steps`` as in the trainer's metrics, so with ``W`` warm-up steps

* step ``s <= W``: ``lr * s / W`` (step ``W`` trains at the peak);
* step ``s > W``: progress ``t = (s - W) / (steps - W)`` in ``(0, 1]`` and
  ``constant``: ``lr``; ``linear``: ``min_lr + (1 - t)(lr - min_lr)``;
  ``cosine``: ``min_lr + (1 + cos(pi t))/2 (lr - min_lr)`` (Loshchilov & Hutter 2017, SGDR, eq. 5
  without restarts).

The rate is a pure function of the step number, so a run resumed at step ``s`` from a checkpoint
(whose metadata records ``next_data_step``) continues on the same curve.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def check_schedule(schedule: str, lr: float, min_lr: float, warmup_steps: int, steps: int) -> None:
    """Raise ``ValueError`` naming the constraint a schedule's settings break."""
    if schedule not in SCHEDULES:
        raise ValueError(f"--lr-schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {warmup_steps}")
    if warmup_steps > steps:
        raise ValueError(f"--warmup-steps {warmup_steps} exceeds --steps {steps}")
    if not 0 <= min_lr <= lr:
        raise ValueError(f"--min-lr {min_lr} must be in [0, --lr {lr}]")


def lr_at(
    step: int, lr: float, steps: int, schedule: str = "constant", warmup_steps: int = 0, min_lr: float = 0.0
) -> float:
    """The learning rate of step ``step`` (1-based) of a ``steps``-step run (see module doc)."""
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant" or steps <= warmup_steps:
        return lr
    t = min(1.0, (step - warmup_steps) / (steps - warmup_steps))
    if schedule == "linear":
        return min_lr + (1.0 - t) * (lr - min_lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * t)) * (lr - min_lr)
