"""Lab 15 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

import torch


def merge_lora(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, alpha: float
) -> torch.Tensor:
    """Lab 15. Merge a LoRA adapter into its base layer's weight.

    A LoRA layer computes ``x W^T + (alpha / r) x A^T B^T`` with the frozen ``weight`` ``W``
    ``[out, in]``, ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` (``r``: the rank, the rows of
    ``lora_A``). Return the one weight ``[out, in]`` that computes the same thing with a plain
    linear layer: ``W + (alpha / r) B A``, as a new tensor (``weight`` stays as it is: the server
    keeps the base for the other adapters). (Hu et al. 2021, "LoRA", §4.1: no added latency once
    merged; peft's ``merge_and_unload``.)
    """
    return weight + (alpha / lora_A.shape[0]) * (lora_B @ lora_A)


EXERCISES = [merge_lora]
