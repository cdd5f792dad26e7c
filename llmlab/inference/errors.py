"""The one engine error that is not a request's: :class:`EngineDeadError`.

Everything else that goes wrong while serving (a bad request, non-finite logits, a sampler or a
forward pass that raises) fails only the requests it concerns and the engine goes on. A part of
the engine that is gone for good (a tensor-parallel rank that exited) cannot be answered per
request: ``LLMEngine.step`` raises this, ``LLM.generate`` raises it to its caller, and the HTTP
server's engine loop stops (``/health`` answers 503).
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (e.g. a tensor-parallel rank exited)."""
