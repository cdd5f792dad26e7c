"""The collectives llmlab issues, each counting the payload bytes it moves.

Every strategy calls these instead of ``torch.distributed`` directly, so a run can report, per
rank, how many bytes went through each kind of collective (CONTRACT ``comm_bytes``).

Payload convention (the one the ZeRO and Megatron papers use for "message volume"): the bytes of
the *full* tensor the collective works on, as seen by this rank:

============================  ===============================================
``all_reduce``, ``broadcast``  bytes of the tensor
``reduce_scatter``            bytes of the (unsharded) input
``all_gather``                bytes of the (gathered) output
``all_to_all``                bytes this rank sends (its input)
``send`` / ``recv``           bytes of the tensor sent / received
============================  ===============================================

A strategy whose traffic should not be mixed with another's passes its own ``kind``: context
parallelism counts its ring K/V blocks as ``cp_ring_send``/``cp_ring_recv`` and its Ulysses
all-to-alls as ``cp_all_to_all`` (not the pipeline's ``send``/``recv`` or expert parallelism's
``all_to_all``). Such keys appear in :meth:`CommCounter.snapshot` once they are non-zero.

Wire traffic differs by algorithm (a ring all-reduce moves 2(N-1)/N of the tensor per rank);
:mod:`llmlab.parallel.data_parallel` measures that separately. Collectives on a group of one rank
(``group=None`` with a 1x mesh, or a single-process run) are no-ops and count nothing.

The counter is per process (each rank is a process); ``COUNTER.reset()`` starts a new tally and
``COUNTER.events`` (when ``record_events`` is on) keeps ``(name, bytes, t_start, t_end)`` for
timelines.
Under a profiler each collective is named ``llmlab.<kind> bytes=N`` in the trace
(:func:`llmlab.metrics.profiling.phase`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Optional

import torch
import torch.distributed as dist

from llmlab.metrics.profiling import phase

#: A process group argument: a group, or ``None`` for the default (whole world) group.
Group = Optional[Any]
#: What an ``async_op`` collective returns: a ``torch.distributed.Work`` (or ``None``).
Work = Any

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send", "recv", "broadcast")

# torch >= 2.13 names the flat-tensor collectives *_single and deprecates (with a FutureWarning
# on every call) all_gather_into_tensor / reduce_scatter_tensor, which older torch only has.
dist_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
dist_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommCounter:
    def __init__(self) -> None:
        self.reset()

    def reset(self, record_events: bool = False) -> None:
        self.bytes: defaultdict[str, int] = defaultdict(int)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.record_events = record_events
        self.events: list[tuple[str, int, float, float]] = []

    def add(self, kind: str, nbytes: int, t0: float | None = None) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1
        if self.record_events and t0 is not None:
            self.events.append((kind, int(nbytes), t0, time.perf_counter()))

    def snapshot(self) -> dict[str, int]:
        """``{kind: bytes}`` for every kind in the CONTRACT (zeros included), plus ``broadcast`` and
        strategy-specific kinds (``cp_ring_send`` ...) when non-zero."""
        return {k: int(self.bytes.get(k, 0)) for k in KINDS if k != "broadcast"} | {
            k: int(v) for k, v in self.bytes.items() if v and (k == "broadcast" or k not in KINDS)
        }


COUNTER = CommCounter()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_size(group: Group) -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _active(group: Group) -> bool:
    return dist.is_initialized() and group_size(group) > 1


def all_reduce(
    t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Group = None, async_op: bool = False
) -> Work:
    """In-place all-reduce of ``t`` over ``group``. Returns a work handle when ``async_op``."""
    if not _active(group):
        return None
    t0 = time.perf_counter()
    with phase("all_reduce", bytes=nbytes(t)):
        work = dist.all_reduce(t, op=op, group=group, async_op=async_op)
    COUNTER.add("all_reduce", nbytes(t), t0)
    return work


def all_gather_into_tensor(
    out: torch.Tensor, inp: torch.Tensor, group: Group = None, async_op: bool = False
) -> Work:
    """Concatenate every rank's ``inp`` along dim 0 into ``out`` (``world * inp.shape[0]`` rows)."""
    if not _active(group):
        out.copy_(inp.reshape(out.shape))
        return None
    t0 = time.perf_counter()
    with phase("all_gather", bytes=nbytes(out)):
        work = dist_all_gather_single(out, inp.contiguous(), group=group, async_op=async_op)
    COUNTER.add("all_gather", nbytes(out), t0)
    return work


def reduce_scatter_tensor(
    out: torch.Tensor,
    inp: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Work:
    """Sum ``inp`` over ranks and keep this rank's ``1/world`` slice of dim 0 in ``out``."""
    if not _active(group):
        out.copy_(inp.reshape(out.shape))
        return None
    t0 = time.perf_counter()
    with phase("reduce_scatter", bytes=nbytes(inp)):
        work = dist_reduce_scatter_single(out, inp.contiguous(), op=op, group=group, async_op=async_op)
    COUNTER.add("reduce_scatter", nbytes(inp), t0)
    return work


def all_to_all_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
    kind: str = "all_to_all",
) -> Work:
    """Exchange slices of dim 0: slice ``i`` of ``inp`` (``in_splits[i]`` rows) goes to rank ``i``.
    Counted under ``kind``."""
    if not _active(group):
        out.copy_(inp)
        return None
    t0 = time.perf_counter()
    with phase(kind, bytes=nbytes(inp)):
        work = dist.all_to_all_single(
            out, inp.contiguous(), out_splits, in_splits, group=group, async_op=async_op
        )
    COUNTER.add(kind, nbytes(inp), t0)
    return work


def broadcast(t: torch.Tensor, src: int, group: Group = None) -> None:
    """Broadcast ``t`` from global rank ``src`` over ``group`` (in place)."""
    if not _active(group):
        return
    t0 = time.perf_counter()
    with phase("broadcast", bytes=nbytes(t)):
        dist.broadcast(t, src=src, group=group)
    COUNTER.add("broadcast", nbytes(t), t0)


def send(t: torch.Tensor, dst: int, group: Group = None) -> None:
    t0 = time.perf_counter()
    with phase("send", bytes=nbytes(t)):
        dist.send(t.contiguous(), dst=dst, group=group)
    COUNTER.add("send", nbytes(t), t0)


def recv(t: torch.Tensor, src: int, group: Group = None) -> None:
    t0 = time.perf_counter()
    with phase("recv", bytes=nbytes(t)):
        dist.recv(t, src=src, group=group)
    COUNTER.add("recv", nbytes(t), t0)


def isend(t: torch.Tensor, dst: int, group: Group = None) -> Work:
    COUNTER.add("send", nbytes(t))
    return dist.isend(t.contiguous(), dst=dst, group=group)


def irecv(t: torch.Tensor, src: int, group: Group = None) -> Work:
    COUNTER.add("recv", nbytes(t))
    return dist.irecv(t, src=src, group=group)


def batch_isend_irecv(ops: list[Any], kind: str | None = None) -> list[Any]:
    """Post a batch of ``dist.P2POp`` together (deadlock-free pairing); counts their bytes under
    ``send``/``recv``, or ``{kind}_send``/``{kind}_recv`` when ``kind`` is given."""
    for op in ops:
        name = "send" if op.op in (dist.isend, getattr(dist, "send", None)) else "recv"
        COUNTER.add(f"{kind}_{name}" if kind else name, nbytes(op.tensor))
    if not ops:
        return []
    with phase(f"{kind + '_' if kind else ''}p2p", ops=len(ops), bytes=sum(nbytes(op.tensor) for op in ops)):
        return dist.batch_isend_irecv(ops)
