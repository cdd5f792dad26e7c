"""The forward context: what a serving engine hands the attention layers for one forward pass.

A serving step batches the new tokens of many sequences into one ``[1, N]`` forward whose keys and
values live in a paged cache, not in the batch. The decoder layers stay the model's own; only the
attention needs to know where each token's K/V goes and which cached tokens each query sees. The
engine sets that metadata here for the duration of the forward (as nano-vllm's
``utils/context.py`` and vLLM's ``forward_context`` do) and :class:`~llmlab.model.llama.Attention`
reads it: with no context set, attention is ordinary causal attention over the batch.

The context is any object with ``attention(layer_idx, q [N, H, D], k [N, Hkv, D], v [N, Hkv, D])
-> [N, H, D]``; llmlab's engine sets :class:`llmlab.inference.attention_context.PagedAttentionContext`.
The model never imports the engine: the dependency points from ``inference`` to ``model``.
"""

from __future__ import annotations

import contextlib
import threading

# Per thread: a server steps its engine (or several replicas) in threads of their own while the
# notebook's or test's main thread may run a plain forward of another model at the same time.
_LOCAL = threading.local()


def get_context():
    """The context of the forward in progress on this thread, or None (plain causal attention)."""
    return getattr(_LOCAL, "ctx", None)


def engine_cpu_fused() -> bool | None:
    """The serving engine's choice of the C++ CPU operators for this forward (the context's
    ``cpu_fused``; ``EngineConfig.cpu_fused``), or None outside an engine (then
    :mod:`llmlab.kernels`' process-wide setting decides)."""
    return getattr(getattr(_LOCAL, "ctx", None), "cpu_fused", None)


@contextlib.contextmanager
def forward_context(ctx):
    """``with forward_context(ctx): model(...)``: the attention layers use ``ctx`` inside."""
    prev = get_context()
    _LOCAL.ctx = ctx
    try:
        yield ctx
    finally:
        _LOCAL.ctx = prev
