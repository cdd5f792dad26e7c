"""Data parallelism: naive DP, DDP with bucketed all-reduce overlapped with backward, ring all-reduce.

Every data-parallel rank holds a full replica of the model, runs forward and backward on its own
rows of the global batch, and then averages the gradients over the ``dp`` group so that every
replica takes the same optimizer step (the same maths as one rank on the whole batch, since the
trainer divides each micro-batch loss so that gradients are global-batch means).

Three ways to average the gradients, side by side so the diff is the lesson:

``naive``  after backward, one ``all_reduce`` per parameter gradient (``NaiveDataParallel``).
``ddp``    gradients are grouped into buckets of ``bucket_mb`` MiB, filled in *reverse*
           registration order (the order backward produces them); a gradient hook copies each
           ready gradient into its bucket, and a full bucket's ``all_reduce`` is launched
           asynchronously at once, so communication overlaps the rest of backward
           (``DistributedDataParallel``; Li et al., "PyTorch Distributed", VLDB 2020, §3.2).
``ring``   the same buckets, reduced after backward by :func:`ring_all_reduce`, an all-reduce
           built from ``send``/``recv`` (each step's pair posted as one batch): a reduce-scatter phase then an all-gather phase, each of
           N-1 steps (Patarasuk & Yuan 2009; Baidu "ring all-reduce" 2017). Each rank sends
           ``2(N-1)/N · K`` bytes for a K-byte tensor, which the send/recv counters measure;
           its time in the α-β model is
           :func:`llmlab.formulas.communication.ring_all_reduce_time`.

All three broadcast the parameters from the group's first rank when wrapping, offer
``no_sync()`` for gradient accumulation (skip communication for all but the last micro-batch)
and ``finish_grad_sync()`` (called once per step before the optimizer: wait for every reduction
and leave averaged gradients in ``p.grad``).

Every mode divides each gradient by the group size *before* the sum (the torch.div in
``Bucket.copy_in``), so the sum is the mean and a 16-bit sum cannot overflow where no rank's
gradient does: the rule every gradient reduction follows, ZeRO's too
(:mod:`llmlab.parallel.grad_reduce`).

Parameters recorded ``expert_parallel`` (expert parallelism; :mod:`llmlab.parallel.records`) are averaged over
``mesh.groups["edp"]`` instead of ``mesh.groups["dp"]``: buckets are kept per process group.

Every collective goes through :mod:`llmlab.runtime.comm`, so ``COUNTER`` reports the bytes: for
``naive``/``ddp`` the ``all_reduce`` payload per step equals the gradient bytes; for ``ring`` the
wire bytes appear as ``send``/``recv``.
"""

from __future__ import annotations

from typing import Any, Iterator

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from llmlab.metrics.timing import EventTimeline
from llmlab.model.config import ModelConfig
from llmlab.parallel.grad_reduce import predivide_
from llmlab.parallel.configs import DataParallelConfig
from llmlab.parallel.protocols import replica_grads
from llmlab.parallel.records import param_record
from llmlab.runtime import comm
from llmlab.metrics.profiling import phase
from llmlab.runtime.mesh import Mesh
from llmlab.runtime.comm import Group

MODES = ("naive", "ddp", "ring")


# --------------------------------------------------------------------------------------------
# Ring all-reduce from send/recv
# --------------------------------------------------------------------------------------------
def ring_all_reduce(t: torch.Tensor, group: Group = None, trace: list[Any] | None = None) -> torch.Tensor:
    """Sum ``t`` (any shape) over ``group`` in place with a ring of send/recv; returns ``t``.

    The flat tensor is split into N chunks (N = group size; the last chunks may be shorter if N
    does not divide ``t.numel()``). Rank i sends to rank i+1 and receives from rank i-1:

    * reduce-scatter, steps s = 0..N-2: send chunk (i-s) mod N, receive chunk (i-s-1) mod N and
      add it to ours. Afterwards rank i holds the full sum of chunk (i+1) mod N.
    * all-gather, steps s = 0..N-2: send chunk (i+1-s) mod N, receive chunk (i-s) mod N and
      overwrite ours. Afterwards every rank holds every summed chunk.

    Each rank sends ``2(N-1)/N · nbytes(t)`` bytes (exactly, when N divides ``t.numel()``),
    independent of N for large N: the reason rings are bandwidth-optimal (Patarasuk & Yuan,
    "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009).
    If ``trace`` is a list, ``(phase, step, chunk_sent, chunk_received, t.clone())`` is appended
    after every step (for the lab). Raises ``ValueError`` if ``t`` is not contiguous.
    """
    if not t.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor")
    n = comm.group_size(group)
    if n == 1:
        return t
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    i = ranks.index(dist.get_rank())
    nxt, prv = ranks[(i + 1) % n], ranks[(i - 1) % n]
    chunks = list(torch.tensor_split(t.view(-1), n))
    buf = torch.empty_like(chunks[0])

    def exchange(send_idx: int, recv_idx: int) -> torch.Tensor:
        # One batch, receive and send posted together: with separate isend/irecv, NCCL runs each
        # rank's send first and a send larger than its buffers waits for the peer's receive, which
        # that peer posts only after its own send: every rank of the ring waits forever.
        recv = buf[: chunks[recv_idx].numel()]
        works = comm.batch_isend_irecv(
            [dist.P2POp(dist.irecv, recv, prv, group), dist.P2POp(dist.isend, chunks[send_idx], nxt, group)]
        )
        for w in works:  # NCCL: one handle for the batch; gloo: one per op
            w.wait()
        return recv

    for s in range(n - 1):  # reduce-scatter
        a, b = (i - s) % n, (i - s - 1) % n
        chunks[b].add_(exchange(a, b))
        if trace is not None:
            trace.append(("reduce-scatter", s, a, b, t.detach().clone()))
    for s in range(n - 1):  # all-gather
        a, b = (i + 1 - s) % n, (i - s) % n
        chunks[b].copy_(exchange(a, b))
        if trace is not None:
            trace.append(("all-gather", s, a, b, t.detach().clone()))
    return t


# --------------------------------------------------------------------------------------------
# Which group reduces a parameter
# --------------------------------------------------------------------------------------------
def _group_key(p: nn.Parameter) -> str:
    return "edp" if param_record(p).expert_parallel else "dp"


def broadcast_parameters(module: nn.Module, mesh: Mesh) -> None:
    """Copy every parameter (and buffer) from the first rank of its group to the others, so all
    replicas start identical even if they were initialised differently."""
    with torch.no_grad():
        for p in module.parameters():
            key = _group_key(p)
            if mesh.size(key) > 1:
                comm.broadcast(p.data, src=mesh.ranks[key][0], group=mesh.groups[key])
        for b in module.buffers():
            if mesh.size("dp") > 1 and b.is_floating_point():
                comm.broadcast(b.data, src=mesh.ranks["dp"][0], group=mesh.groups["dp"])


class _DataParallelBase(nn.Module):
    """Shared parts: the replica, parameter broadcast, the ``no_sync`` flag; the gradients are the
    parameters' own (:class:`~llmlab.parallel.protocols.TrainedModule`)."""

    def __init__(self, module: nn.Module, mesh: Mesh) -> None:
        super().__init__()
        self.module, self.mesh = module, mesh
        self.require_backward_grad_sync = True
        self.params = [p for p in module.parameters() if p.requires_grad]
        broadcast_parameters(module, mesh)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this context backward accumulates gradients locally without communication."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def grad_of(self, p: nn.Parameter) -> torch.Tensor | None:
        return p.grad

    def grad_tensors(self) -> list[torch.Tensor]:
        return replica_grads(self.module)


class NaiveDataParallel(_DataParallelBase):
    """After backward, one blocking ``all_reduce`` (then ÷ group size) per parameter gradient.

    Simple and correct, but nothing overlaps: communication starts only once backward is over,
    and many small messages pay the per-message latency many times.
    """

    def finish_grad_sync(self) -> None:
        if not self.require_backward_grad_sync:
            return
        for p in self.params:
            key = _group_key(p)
            size = self.mesh.size(key)
            if size == 1:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            predivide_(p.grad, size)  # before the sum, so 16-bit gradients cannot overflow
            comm.all_reduce(p.grad, group=self.mesh.groups[key])


class Bucket:
    """Gradients of several parameters packed into one flat buffer, reduced as one message."""

    def __init__(self, params: list[nn.Parameter], key: str, group: Group, size: int, index: int) -> None:
        self.params, self.key, self.group, self.size, self.index = params, key, group, size, index
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.buffer = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)
        self.nbytes = n * self.buffer.element_size()
        # One view per parameter, made once: the per-step path only copies into them.
        self.views = [self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, params)]
        self.reset()

    def reset(self) -> None:
        self.ready: set[int] = set()
        self.work: Any = None
        self.launched = False

    def view(self, j: int) -> torch.Tensor:
        return self.views[j]

    def copy_in(self, j: int) -> None:
        """Put parameter ``j``'s gradient, divided by the group size, into the bucket: the sum
        over ranks is then the average. Dividing before the sum keeps 16-bit sums finite (as
        PyTorch's default hook), and dividing while copying saves a pass over the bucket."""
        g, v = self.params[j].grad, self.views[j]
        if g is None:
            v.zero_()
        elif g.data_ptr() != v.data_ptr():
            torch.div(g, self.size, out=v)
        else:  # accumulated in place into the bucket (p.grad kept from the last step)
            predivide_(v, self.size)

    def copy_out(self) -> None:
        """Hand the reduced buffer back: ``p.grad`` becomes a view of the bucket."""
        for p, v in zip(self.params, self.views):
            p.grad = v


FIRST_BUCKET_MB = 1.0  # PyTorch DDP's _DEFAULT_FIRST_BUCKET_BYTES (1 MiB)


def build_buckets(
    params: list[nn.Parameter],
    mesh: Mesh,
    bucket_bytes: float,
    first_bucket_bytes: float = FIRST_BUCKET_MB * 2**20,
) -> list[Bucket]:
    """Group ``params`` into buckets of about ``bucket_bytes`` each, in reverse order.

    Reverse registration order approximates the order backward produces gradients (the last
    layer first), so the first bucket fills first, as in PyTorch DDP
    (``_compute_bucket_assignment_by_size``). A bucket closes once it holds its limit or more:
    ``min(first_bucket_bytes, bucket_bytes)`` for the first bucket (small, so communication
    starts early in backward, as PyTorch does), ``bucket_bytes`` after that. Parameters of
    different groups (dp / edp), dtypes or devices never share a bucket. Parameters whose group
    has a single rank need no bucket.
    """
    open_: dict[tuple[str, torch.dtype, torch.device], list[nn.Parameter]] = {}
    closed: set[tuple[str, torch.dtype, torch.device]] = set()
    out: list[list[nn.Parameter]] = []
    for p in reversed(params):
        key = _group_key(p)
        if mesh.size(key) == 1:
            continue
        k = (key, p.dtype, p.device)
        cur = open_.setdefault(k, [])
        cur.append(p)
        limit = bucket_bytes if k in closed else min(first_bucket_bytes, bucket_bytes)
        if sum(q.numel() * q.element_size() for q in cur) >= limit:
            out.append(cur)
            open_[k] = []
            closed.add(k)
    out.extend(b for b in open_.values() if b)
    buckets = []
    for i, ps in enumerate(out):
        key = _group_key(ps[0])
        buckets.append(Bucket(ps, key, mesh.groups[key], mesh.size(key), i))
    return buckets


class DistributedDataParallel(_DataParallelBase):
    """Bucketed gradient all-reduce launched from gradient hooks, overlapping backward.

    ``register_post_accumulate_grad_hook`` fires when a parameter's ``.grad`` is final for this
    backward. The hook copies it into its bucket; when a bucket has all its gradients, its
    ``all_reduce`` is launched with ``async_op=True``. Buckets are launched strictly in index
    order (a ready bucket waits for the earlier ones) so every rank issues the collectives in the
    same order even if gradients arrive in a different order. ``finish_grad_sync`` launches the
    buckets whose parameters got no gradient (unused parameters count as zero), waits for all,
    and leaves ``p.grad`` as a view of its bucket. Each bucket is divided by the group size
    *before* the sum (as PyTorch's default comm hook does), so fp16/bf16 sums stay finite.

    With ``record_timeline=True``, ``timeline`` collects ``("backward_start"|"grad_ready"|
    "launch"|"done", bucket or None, t)`` events (``time.perf_counter`` seconds); "done" is
    taken when the collective has run (gloo: its future; CUDA: an event on a side stream that
    waits for it, :class:`~llmlab.metrics.timing.EventTimeline`), so the list shows the real
    overlap on a GPU too.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        record_timeline: bool = False,
    ) -> None:
        super().__init__(module, mesh)
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.bucket_mb, self.overlap = bucket_mb, overlap
        self.buckets = build_buckets(self.params, mesh, bucket_mb * 2**20)
        self.next_bucket = 0
        self.record_timeline = record_timeline
        self.timeline: list[Any] = []
        device = self.buckets[0].buffer.device if self.buckets else torch.device("cpu")
        self._clock = EventTimeline(device, self.timeline)  # CUDA events on a GPU
        # One hook per parameter that knows its bucket and slot (no lookup on the hot path).
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, b, j))
            for b in self.buckets
            for j, p in enumerate(b.params)
        ]

    # --- hooks ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        if self.record_timeline and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: self._event("backward_start", None))
        return out

    def _event(self, kind: str, bucket: int | None) -> None:
        if self.record_timeline:
            self._clock.mark(kind, bucket)

    def _grad_ready(self, b: Bucket, j: int, p: nn.Parameter) -> None:
        """Gradient hook of parameter ``j`` of bucket ``b``: copy it in; launch what is complete."""
        if not self.require_backward_grad_sync or not self.overlap:
            return
        if b.launched or j in b.ready:
            raise RuntimeError(
                "a gradient became ready twice in one synchronised backward; "
                "wrap all but the last micro-batch in no_sync()"
            )
        b.copy_in(j)
        b.ready.add(j)
        if self.record_timeline:
            self._event("grad_ready", b.index)
        if len(b.ready) == len(b.params) and b.index == self.next_bucket:
            self._launch_ready()

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        self._event("launch", b.index)
        with phase("ddp bucket all_reduce", bucket=b.index, bytes=b.nbytes):
            b.work = comm.all_reduce(b.buffer, group=b.group, async_op=True)
        if self.record_timeline:  # when the all-reduce has run (not when NCCL queued it)
            self._clock.mark_done("done", b.index, b.work)

    def _launch_ready(self) -> None:
        while self.next_bucket < len(self.buckets):
            b = self.buckets[self.next_bucket]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)
            self.next_bucket += 1

    # --- end of step ------------------------------------------------------------------------
    def finish_grad_sync(self) -> None:
        """Wait until every bucket is reduced; ``p.grad`` then holds the group average."""
        if not self.require_backward_grad_sync:
            return
        for b in self.buckets[self.next_bucket :]:
            for j in range(len(b.params)):
                if j not in b.ready:  # no gradient this step, or overlap off
                    b.copy_in(j)
            self._launch(b)
        for b in self.buckets:
            with phase("ddp bucket wait", bucket=b.index):
                b.work.wait()
            b.copy_out()
            b.reset()
        self._clock.resolve()
        self.next_bucket = 0

    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket, in launch order."""
        return [b.nbytes for b in self.buckets]


class RingDataParallel(DistributedDataParallel):
    """The ``ddp`` buckets, each reduced after backward with :func:`ring_all_reduce`."""

    def __init__(self, module: nn.Module, mesh: Mesh, bucket_mb: float = 25.0) -> None:
        super().__init__(module, mesh, bucket_mb=bucket_mb, overlap=False)

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        ring_all_reduce(b.buffer, group=b.group)
        b.work = _Done()


class _Done:
    def wait(self) -> bool:
        return True


def wrap_data_parallel(
    module: nn.Module, mesh: Mesh, mode: str = "ddp", bucket_mb: float = 25.0, **kwargs: Any
) -> nn.Module:
    """Wrap ``module`` for data parallelism over ``mesh`` (``mode`` in naive, ddp, ring).

    Returns a :class:`~llmlab.parallel.protocols.TrainedModule` (``forward``, ``.module``,
    ``no_sync()``, ``finish_grad_sync()``, ``grad_of``, ``grad_tensors``). Broadcasts the parameters
    from each group's first rank; must be called on every rank. Raises ``ValueError`` for an
    unknown mode or ``bucket_mb <= 0``.
    """
    if mode == "naive":
        return NaiveDataParallel(module, mesh)
    if mode == "ddp":
        return DistributedDataParallel(module, mesh, bucket_mb=bucket_mb, **kwargs)
    if mode == "ring":
        return RingDataParallel(module, mesh, bucket_mb=bucket_mb)
    raise ValueError(f"data-parallel mode {mode!r}: expected one of {', '.join(MODES)}")


# --------------------------------------------------------------------------------------------
# The strategy's contract (llmlab.parallel.protocols)
# --------------------------------------------------------------------------------------------
def validate(config: DataParallelConfig, mesh: Mesh, model_config: ModelConfig) -> None:
    """Refuse, before any rank starts, a layout data parallelism cannot run (``ValueError``
    naming the constraint and the flag): an unknown mode, ``bucket_mb <= 0``, a global batch the
    ``mesh.dp`` replicas cannot split evenly, or a per-rank batch ``num_microbatches`` cannot."""
    if config.mode not in MODES:
        raise ValueError(f"--dp-mode {config.mode!r}: expected one of {', '.join(MODES)}")
    if config.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb must be > 0, got {config.bucket_mb}")
    gbs, dp, m = config.global_batch_size, mesh.dp, config.num_microbatches
    if gbs % dp:
        raise ValueError(f"dp={dp} must divide --global-batch-size {gbs}")
    if (gbs // dp) % m:
        raise ValueError(
            f"--num-microbatches {m} must divide the per-rank batch {gbs // dp} "
            f"(global batch {gbs} / dp {dp})"
        )


def apply(model: nn.Module, mesh: Mesh, config: DataParallelConfig) -> nn.Module:
    """Wrap ``model`` (this rank's replica) for data parallelism over ``mesh``'s ``dp`` group
    (the trainer passes the data x context-parallel view): :func:`wrap_data_parallel` with the
    config's mode and bucket size."""
    return wrap_data_parallel(model, mesh, mode=config.mode, bucket_mb=config.bucket_mb)
