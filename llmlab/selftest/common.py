"""What every self-test check shares: the verdicts, :class:`Skip`, the device."""

from __future__ import annotations

import torch

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
BF16_INTERPRETER = "bf16 skipped on CPU: Triton 3.9's interpreter multiplies bf16 tl.dot operands as raw bits"


class Skip(Exception):
    """Raised by a check the machine cannot run; the message is the reason."""


def _gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _dev() -> str:
    return "cuda" if _gpu() else "cpu"
