"""ZeRO stages 1, 2 and 3: shard the model states over the data-parallel ranks.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", §5) removes the redundancy of data parallelism. With Ψ parameters, mixed-precision
Adam holds per rank 2Ψ (bf16 weights) + 2Ψ (bf16 gradients) + KΨ (K = 12: fp32 master weights,
Adam m and v) bytes; in plain fp32 it is 4Ψ + 4Ψ + 8Ψ. Over N data-parallel ranks:

========  ============================  ======================  ==================================
stage     sharded                       bytes per rank          communication per step (§7)
========  ============================  ======================  ==================================
0 (DDP)   nothing                       2Ψ + 2Ψ + KΨ            all-reduce grads: 2Ψ
1         optimizer states              2Ψ + 2Ψ + KΨ/N          reduce-scatter + all-gather: 2Ψ
2         + gradients                   2Ψ + (2Ψ + KΨ)/N        reduce-scatter + all-gather: 2Ψ
3         + parameters                  (2Ψ + 2Ψ + KΨ)/N        all-gather ×2 + reduce-scatter: 3Ψ
========  ============================  ======================  ==================================

How this file does it (the layout is in :mod:`llmlab.parallel.zero_buffers`, the optimizer of the
shard in :mod:`llmlab.parallel.zero_optimizer`):

* Stage 1: parameters live in flat buckets; gradients accumulate in a full flat gradient buffer;
  ``finish_grad_sync`` reduce-scatters it so each rank holds the summed gradient of its shard;
  the optimizer updates only that shard (its Adam moments, and fp32 master weights under mixed
  precision, exist only for the shard); ``step`` all-gathers the updated parameters.
* Stage 2: during backward each parameter's gradient is copied into its bucket and freed; when a
  bucket is complete it is reduce-scattered (asynchronously, overlapping the rest of backward)
  into this rank's gradient shard, and the bucket is dropped. Buckets follow backward order and
  are launched in that order on every rank.
* Stage 3: each decoder layer (and the embedding, final norm, LM head) is a bucket that keeps only
  its shard between uses. A forward pre-hook all-gathers the layer (prefetching the next one), a
  forward hook frees it; a hook on the layer's output gradient gathers it again for backward
  (prefetching the previous layer), and once its gradients are in, they are reduce-scattered and
  the layer is freed. The optimizer updates the shards; there is nothing to gather after it.
* ``--cpu-offload`` (ZeRO-Offload, Ren et al. 2021): fp32 master weights and Adam moments of the
  shard live in host memory; the gradient shard goes to the host, Adam runs there, the updated
  shard comes back (cast to the compute dtype).

Gradient accumulation: stage 1 accumulates micro-batches locally and communicates once per step;
stages 2 and 3 reduce-scatter after every micro-batch (as DeepSpeed does) so that full gradients
never accumulate; ``no_sync()`` is accepted and changes nothing for them. Communication is then
``(M + 1)Ψ`` (stage 2) and ``(2M + M)Ψ`` (stage 3) for ``M`` micro-batches.

Every bucket is divided by N *before* it is reduce-scattered, so the sum is already the mean and
an fp16 sum cannot overflow where no rank's gradient does (the one rule for every gradient
reduction, DDP's too: :mod:`llmlab.parallel.grad_reduce`).

Every collective goes through :mod:`llmlab.runtime.comm`, so the bytes are counted per rank. The
table's formulas are :func:`llmlab.formulas.memory.zero_model_state_bytes` and
:func:`llmlab.formulas.communication.zero_comm_bytes_per_step`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.model.config import ModelConfig
from llmlab.parallel.grad_reduce import predivide_
from llmlab.parallel.configs import ZeroConfig
from llmlab.parallel.records import param_record
from llmlab.parallel.zero_buffers import FlatBucket
from llmlab.parallel.zero_optimizer import LossScaler, ZeroOptimizer
from llmlab.runtime import comm
from llmlab.metrics.profiling import phase as profile_phase
from llmlab.runtime.mesh import Mesh
from torch.nn import Module


def validate(cfg: ZeroConfig, mesh: Mesh, model_config: ModelConfig) -> None:
    """Refuse ZeRO layouts this version does not handle (``ValueError`` naming the constraint).

    ``--zero`` with ``--dp 1`` is allowed (N = 1: nothing is sharded, a baseline for the lab).
    ZeRO composes with ``--tp``, ``--pp`` and ``--ep``: it shards over the data-parallel group
    inside each tensor/pipeline slice, and expert parameters over their expert-data-parallel group.
    """
    if cfg.cpu_offload and cfg.stage == 0:
        raise ValueError("--cpu-offload offloads ZeRO optimizer states: it needs --zero 1, 2 or 3")
    if cfg.stage == 0:
        return
    if cfg.stage == 3 and model_config.tie_word_embeddings:
        raise ValueError(
            "--zero 3 with tie_word_embeddings is not supported (the tied weight would "
            "belong to two units, the embedding's and the LM head's, and be gathered "
            "and reduced twice); untie the embeddings or use --zero 1 or 2"
        )


def _size_buckets(
    params: list[tuple[str, nn.Parameter]], cap_bytes: float, elsize: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Split ``params`` (already in backward order) into runs of at most ``cap_bytes`` that never
    mix dense and expert parameters (they are reduced over different groups)."""
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    cur: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, p in params:
        if cur and (size + p.numel() * elsize > cap_bytes or _is_expert(p) != _is_expert(cur[-1][1])):
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, p))
        size += p.numel() * elsize
    if cur:
        buckets.append(cur)
    return buckets


def _held(t: torch.Tensor | None) -> torch.Tensor:
    """``t``, a buffer the wrapper's stage has allocated (gradient buffers, stage 3's shard)."""
    assert t is not None, "a ZeRO buffer used before its stage allocated it"
    return t


def _is_expert(p: nn.Parameter) -> bool:
    return param_record(p).expert_parallel


def _split_by_group(ps: list[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
    """``ps`` split into the dense run and the expert run (either may be empty)."""
    return [
        run for run in ([q for q in ps if not _is_expert(q[1])], [q for q in ps if _is_expert(q[1])]) if run
    ]


def zero3_units(module: nn.Module) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Stage-3 units in forward order: each ``layers.<i>`` block whole, and every other module
    that owns parameters directly (embedding, final norm, LM head) as its own unit. Only
    parameters that require a gradient are listed (frozen ones stay whole and untouched)."""
    units: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]] = []
    claimed: list[str] = []
    for name, m in module.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        if re.search(r"(^|\.)layers\.\d+$", name):
            claimed.append(name)
            ps = [(f"{name}.{n}", p) for n, p in m.named_parameters()]
        else:
            ps = [(f"{name}.{n}" if name else n, p) for n, p in m.named_parameters(recurse=False)]
        ps = [(n, p) for n, p in ps if p.requires_grad]
        if ps:
            units.append((name, m, ps))
    return units


class ZeroDataParallel(nn.Module):
    """Data parallelism with ZeRO ``stage`` (1, 2 or 3) over ``mesh.groups["dp"]``.

    On a mesh with tensor, pipeline or expert parallelism, ``module`` is this rank's shard of
    the model (its tp slice, its pipeline stage, its experts) and ZeRO shards it over the
    data-parallel group of that slice, as Megatron's distributed optimizer does; parameters
    recorded ``expert_parallel`` (:mod:`llmlab.parallel.records`) are sharded over the
    expert-data-parallel group ``edp`` instead
    (the other holders of the same experts). Gradients are averaged over the bucket's group,
    divided by its size before the reduce-scatter (:mod:`llmlab.parallel.grad_reduce`).
    Parameters with ``requires_grad=False`` are left out: never sharded, reduced or updated.

    Follows the trainer's LocalModule protocol: ``forward(*args)`` runs ``module``;
    ``no_sync()``; ``finish_grad_sync()`` (after the last backward of a step: every gradient
    reduced, divided by N, in this rank's shard); ``grad_tensors()`` (the gradient buffers this
    rank holds). ``dtype="bf16"``/``"fp16"`` stores parameters and gradients in 16 bits (fp32
    masters live in :class:`ZeroOptimizer`). ``bucket_mb``: stage 1/2 bucket size in MiB of
    parameters. ``events`` lists the first ``max_events`` collectives issued (op, unit, phase, time).

    Stages 2 and 3 reduce-scatter every bucket once per backward pass: when its last gradient
    arrives, or, for a bucket some of whose parameters got no gradient on this rank in this pass
    (unused parameter, a pipeline chunk that did not run), at the end of the pass (an autograd
    engine callback, as PyTorch DDP does) with zeros in their place. Every rank therefore issues
    the same collectives in the same order.
    """

    def __init__(
        self, module: nn.Module, mesh: Mesh, stage: int, dtype: str = "fp32", bucket_mb: float = 25.0
    ) -> None:
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage {stage}: expected 1, 2 or 3")
        self.module, self.stage = module, stage
        self.group = mesh.groups.get("dp")
        self.world = comm.group_size(self.group)
        groups_of = {False: self.group, True: mesh.groups.get("edp")}
        self.compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        device = next(module.parameters()).device
        self.param_names = [n for n, _ in module.named_parameters()]
        self.events: list[dict[str, Any]] = []
        self.max_events = 2000

        def bucket(name: str, ps: list[tuple[str, nn.Parameter]]) -> FlatBucket:
            g = groups_of[_is_expert(ps[0][1])]
            n = comm.group_size(g)
            b = FlatBucket(name, ps, n, dist.get_rank(g) if n > 1 else 0, self.compute_dtype, device)
            b.group = g
            return b

        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if stage == 3:
            units = zero3_units(module)
            unit_buckets = [
                [
                    bucket((name or "root") + ("" if not _is_expert(ps[0][1]) else ".experts"), ps)
                    for ps in _split_by_group(ups)
                ]
                for name, _, ups in units
            ]
            self.buckets = [b for bs in unit_buckets for b in bs]
        else:
            params = trainable[::-1]  # backward order
            self.buckets = [
                bucket(f"bucket{i}", ps)
                for i, ps in enumerate(
                    _size_buckets(params, bucket_mb * 2**20, torch.finfo(self.compute_dtype).bits // 8)
                )
            ]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._pending: list[Any] = []  # in-flight reduce-scatters: (bucket, out, work, staging)
        self._next_launch = 0
        self._callback_queued = False
        self._gathering: dict[tuple[int, int], Any] = {}  # (unit, bucket) -> the gather's work
        if stage == 1:
            for b in self.buckets:
                b.grad_full = torch.zeros_like(b.full)
                b.attach_grads(b.grad_full)
        else:
            for b in self.buckets:
                b.grad_shard = torch.zeros(b.shard_numel, dtype=self.compute_dtype, device=device)
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._on_grad)
        if stage == 3:
            # Stage-3 bucket order for gradients is backward order: the reverse of forward.
            self.units = unit_buckets
            self.buckets = self.buckets[::-1]
            for i, ((name, m, _), bs) in enumerate(zip(units, self.units)):
                for b in bs:
                    # Like FSDP1's FlatParameter: the shard is a registered parameter of its unit,
                    # so model.parameters() (and the trainer's byte count) sees what the rank holds.
                    attr = "flat_param_shard" + ("_experts" if b.name.endswith(".experts") else "")
                    m.register_parameter(attr, nn.Parameter(b.make_local_shard(), requires_grad=False))
                    b.local_shard = getattr(m, attr)
                    b.free()
                m.register_forward_pre_hook(functools.partial(self._pre_forward, i))
                m.register_forward_hook(functools.partial(self._post_forward, i))

    # --- LocalModule protocol -------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.nullcontext[None]:
        """Stage 1 reduces once per step anyway; stages 2/3 reduce every micro-batch."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Reduce-scatter what is left and wait: the gradient shards hold the mean over N.

        Every bucket is divided by N *before* its reduce-scatter (:func:`predivide_`, the rule of
        :mod:`llmlab.parallel.grad_reduce`, as DDP does), so an fp16 sum cannot overflow where no
        rank's gradient does."""
        if self.stage == 1:
            for b in self.buckets:
                full = _held(b.grad_full)
                out = torch.empty(b.shard_numel, dtype=full.dtype, device=full.device)
                self.log_event("reduce_scatter", b.name, "step")
                comm.reduce_scatter_tensor(out, predivide_(full, b.world), group=b.group)
                a, e = b.shard_range
                full[a:e].copy_(out)
            return
        if self._next_launch:
            self._end_of_backward()
        while self._pending:
            self._retire()
        if self.stage == 3:
            for i in range(len(self.units)):
                self._free_unit(i)

    def grad_tensors(self) -> list[torch.Tensor]:
        """Gradient buffers held by this rank: full flat buffers (stage 1) or shards (2, 3)."""
        return [_held(b.grad_full if self.stage == 1 else b.grad_shard) for b in self.buckets]

    @torch.no_grad()
    def zero_grad_buffers(self) -> None:
        for b in self.buckets:
            if self.stage == 1:
                b.attach_grads(_held(b.grad_full).zero_())
            else:
                _held(b.grad_shard).zero_()

    def grad_shard(self, b: FlatBucket) -> torch.Tensor:
        """The reduced gradient of bucket ``b``'s shard (after ``finish_grad_sync``)."""
        g = b.grad_full if self.stage == 1 else b.grad_shard
        assert g is not None, "gradient buffers exist once the wrapper is built"
        if self.stage == 1:
            a, e = b.shard_range
            return g[a:e]
        return g

    def grad_of(self, p: nn.Parameter) -> torch.Tensor | None:
        """After ``finish_grad_sync``: the part of ``p``'s reduced gradient in this rank's shard
        (a view, possibly empty), or ``None`` for a parameter ZeRO does not hold (frozen)."""
        b = self._bucket_of.get(id(p))
        if b is None:
            return None
        i = b.index[id(p)]
        lo, hi = b.shard_range
        a, e = max(b.offsets[i], lo), min(b.offsets[i] + b.numels[i], hi)
        return self.grad_shard(b)[a - lo : max(a, e) - lo]

    # --- stages 2 and 3: gradients ----------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._callback_queued:  # reduce what is incomplete when this backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        b = self._bucket_of[id(p)]
        assert p.grad is not None  # the hook runs once p.grad is accumulated
        if b.grad_full is None:
            b.grad_full = torch.zeros(b.padded, dtype=p.grad.dtype, device=p.grad.device)
        b.copy_grad_in(p, b.grad_full)
        p.grad = None  # the full gradient of this parameter is gone
        b.num_ready += 1
        if b.num_ready == b.num_grads:
            if self.stage == 3:
                b.free()
            # Launch in bucket order, identical on every rank.
            while (
                self._next_launch < len(self.buckets)
                and self.buckets[self._next_launch].num_ready >= self.buckets[self._next_launch].num_grads
            ):
                self._launch(self.buckets[self._next_launch], "backward")
                self._next_launch += 1

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        """Launch, in order, every bucket not yet reduced in this backward pass (zeros where a
        parameter got no gradient), so that all ranks issue the same reduce-scatters."""
        for b in self.buckets[self._next_launch :]:
            if b.grad_full is None:
                b.grad_full = torch.zeros(
                    b.padded, dtype=self.compute_dtype, device=_held(b.grad_shard).device
                )
            self._launch(b, "backward" if b.num_ready else "flush")
        self._next_launch = 0
        self._callback_queued = False
        if self.stage == 3:
            for i in range(len(self.units)):
                self._free_unit(i)

    def _launch(self, b: FlatBucket, phase: str) -> None:
        full = b.grad_full
        assert full is not None  # filled by _on_grad, or zeros from _end_of_backward
        out = torch.empty(b.shard_numel, dtype=full.dtype, device=full.device)
        self.log_event("reduce_scatter", b.name, phase)
        with profile_phase("zero reduce_scatter", bucket=b.name, bytes=full.numel() * full.element_size()):
            work = comm.reduce_scatter_tensor(out, predivide_(full, b.world), group=b.group, async_op=True)
        self._pending.append((b, out, work, full))
        b.grad_full, b.num_ready = None, 0
        while len(self._pending) > 2:  # at most two buckets in flight: bounded memory
            self._retire()

    def _retire(self) -> None:
        b, out, work, _staging = self._pending.pop(0)
        if work is not None:
            with profile_phase("zero reduce_scatter wait", bucket=b.name):
                work.wait()
        b.grad_shard.add_(out)

    # --- stage 3: parameters ----------------------------------------------------------------
    @torch.no_grad()
    def _gather(self, i: int, phase: str, wait: bool = True) -> None:
        for j, b in enumerate(self.units[i]):
            key = (i, j)
            if not b.is_full and key not in self._gathering:
                b.allocate()
                self.log_event("all_gather", b.name, phase)
                with profile_phase("zero all_gather", unit=b.name, during=phase):
                    self._gathering[key] = comm.all_gather_into_tensor(
                        b.alias, _held(b.local_shard).detach(), group=b.group, async_op=True
                    )
            if wait and key in self._gathering:
                work = self._gathering.pop(key)
                if work is not None:
                    with profile_phase("zero all_gather wait", unit=b.name):
                        work.wait()

    def _free_unit(self, i: int) -> None:
        """Free unit ``i``'s gathered parameters (after any gather of it still in flight)."""
        for j, b in enumerate(self.units[i]):
            work = self._gathering.pop((i, j), None)
            if work is not None:
                work.wait()
            b.free()

    def _pre_forward(self, i: int, module: Module, args: Any) -> None:
        self._gather(i, "forward")
        if i + 1 < len(self.units):
            self._gather(i + 1, "forward", wait=False)  # prefetch the next layer

    def _post_forward(self, i: int, module: Module, args: Any, output: Any) -> Any:
        self._free_unit(i)  # a prefetch of layer i + 1 may still be in flight
        if torch.is_grad_enabled():
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, i))
                    break
        return output

    def _pre_backward(self, i: int, grad: Tensor) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self._gather(i, "backward")
        if i > 0:
            self._gather(i - 1, "backward", wait=False)  # prefetch the previous layer
        return None

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{name: fp32 tensor}`` of this rank's module, whole (collective over the dp and edp
        groups on stage 3)."""
        if self.stage == 3:
            for i in range(len(self.units)):
                self._gather(i, "state_dict")
        params = dict(self.module.named_parameters())
        out = {n: params[n].detach().float().clone() for n in self.param_names}
        if self.stage == 3:
            for i in range(len(self.units)):
                self._free_unit(i)
        return out

    def log_event(self, op: str, unit: str, phase: str) -> None:
        """Record a collective (``op`` on bucket/unit ``unit`` during ``phase``) in ``events``."""
        if len(self.events) < self.max_events:  # bounded: a long run keeps the first ones
            self.events.append({"op": op, "unit": unit, "phase": phase, "t": time.perf_counter()})


def apply(
    module: nn.Module,
    mesh: Mesh,
    cfg: ZeroConfig,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    scaler: LossScaler | None = None,
) -> tuple[ZeroDataParallel, ZeroOptimizer]:
    """The strategy's ``apply``: ``(ZeroDataParallel, ZeroOptimizer)`` for ``cfg.stage`` and
    ``cfg.dtype`` over ``mesh``'s ``dp`` group. ZeRO shards the optimizer's states too, so unlike
    the other strategies it builds the optimizer: ``make_optimizer`` builds the torch optimizer
    from a list of tensors (the fp32 shard masters); ``scaler``: the fp16 loss scaler whose
    scale ``unscale`` removes. ``module`` is this rank's replica (already on its device, fp32).
    """
    wrapper = ZeroDataParallel(module, mesh, stage=cfg.stage, dtype=cfg.dtype, bucket_mb=cfg.bucket_mb)
    return wrapper, ZeroOptimizer(wrapper, make_optimizer, cpu_offload=cfg.cpu_offload, scaler=scaler)
