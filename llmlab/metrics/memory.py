"""Per-rank memory, counted from the tensors a rank actually holds.

* :func:`tensor_bytes` sums ``untyped_storage().nbytes()`` over tensors, each storage once, so a
  view or a tied weight is not counted twice and a flat ZeRO buffer counts as what it is.
* :func:`param_bytes`, :func:`grad_bytes`, :func:`optimizer_state_bytes`: the model states of
  the ZeRO paper (Rajbhandari et al. 2020, §3.1: parameters, gradients, optimizer states).
* :class:`SavedActivations`: peak bytes saved for backward, through autograd's saved-tensor hooks
  (parameters excluded: a weight saved by a matmul is not an activation).
* :func:`cuda_memory`: the CUDA caching allocator's live and peak bytes, on GPU.

Exact accounting is deterministic, unlike the OS's RSS (``tracemalloc`` does not see tensors at
all), which is why the labs use it as the main number.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` entries skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), t.device)
        if key in seen or s.nbytes() == 0:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def param_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of parameters (``model.parameters()`` or any tensors)."""
    return tensor_bytes(params)


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the ``.grad`` tensors currently held by ``params``."""
    return tensor_bytes(p.grad for p in params)


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of every tensor in ``optimizer.state`` (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``).
    ``optimizer``: a ``torch.optim.Optimizer``, or any object with ``state`` (the trainer's) that
    may wrap one as ``optim`` or ``optimizer`` (read when its own ``state`` is empty)."""
    inner = getattr(optimizer, "optim", None) or getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer and not optimizer.state:
        optimizer = inner
    return tensor_bytes(
        v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )


class _Held:
    """What autograd keeps for a saved tensor while we track it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivations:
    """Context manager measuring the bytes autograd saves for backward.

    ``current`` is the live total, ``peak`` its maximum while active (bytes). Storages are
    counted once however many ops save them. ``exclude`` (e.g. ``model.parameters()``) are never
    counted. Saved tensors are released when autograd frees its graph (after ``backward``), and
    ``current`` drops accordingly, so a pipeline schedule's in-flight micro-batches show up.

    Example::

        with SavedActivations(model.parameters()) as act:
            loss = model(x, y); loss.backward()
        act.peak  # bytes
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        # Keyed by the storage object, not its address: ZeRO-3/FSDP free a parameter's storage
        # (resize to 0) and re-allocate it, so the address changes while the storage stays.
        self._exclude = {t.untyped_storage()._cdata for t in exclude}
        self._live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if s._cdata in self._exclude or s.nbytes() == 0 or t.device.type == "meta":
            return t
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [1, s.nbytes()]
            self.current += s.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        held = _Held(t)
        weakref.finalize(held, self._release, ptr)
        return held

    @staticmethod
    def _unpack(h):
        return h.tensor if isinstance(h, _Held) else h

    def _release(self, ptr: int):
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[ptr]

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


def reset_cuda_peak(device=None) -> None:
    """Start a new peak on a CUDA ``device`` (the caching allocator's peak lasts for the process,
    so a second run in one notebook would otherwise report the first run's peak); no-op on CPU."""
    if torch.cuda.is_available() and torch.device(device or "cuda").type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_memory(device=None) -> dict[str, int]:
    """``{"allocated", "peak_allocated", "reserved"}`` bytes on a CUDA device; ``{}`` on CPU."""
    if not torch.cuda.is_available():
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
    }
