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

How this file does it (the layout is in :mod:`llmlab.parallel.zero_buffers`):

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

Every collective goes through :mod:`llmlab.runtime.comm`, so the bytes are counted per rank. The
table's formulas are :func:`llmlab.formulas.memory.zero_model_state_bytes` and
:func:`llmlab.formulas.communication.zero_comm_bytes_per_step`.
"""
from __future__ import annotations

import contextlib
import functools
import re
import time

import torch
import torch.distributed as dist
from torch import nn

from llmlab.parallel.zero_buffers import FlatBucket
from llmlab.runtime import comm

def validate_layout(cfg, model_config) -> None:
    """Refuse ZeRO layouts this version does not handle (``ValueError`` naming the constraint).

    ``--zero`` with ``--dp 1`` is allowed (N = 1: nothing is sharded, a baseline for the lab).
    """
    if cfg.cpu_offload and cfg.zero == 0:
        raise ValueError("--cpu-offload offloads ZeRO optimizer states: it needs --zero 1, 2 or 3")
    if cfg.zero == 0:
        return
    for flag in ("tp", "pp", "ep"):
        if getattr(cfg, flag) > 1 and not (flag == "pp" and cfg.zero == 1):
            raise ValueError(f"--zero {cfg.zero} with --{flag} {getattr(cfg, flag)} > 1 is not "
                             f"supported yet (ZeRO here shards a whole replica, or with --zero 1 "
                             f"a pipeline stage, over --dp)")
    if cfg.zero >= 2 and model_config.num_experts:
        raise ValueError(f"--zero {cfg.zero} needs a dense model: experts that get no tokens on "
                         f"some ranks would reorder the gradient reduce-scatters (use --zero 1)")
    if cfg.zero == 3 and model_config.tie_word_embeddings:
        raise ValueError("--zero 3 with tie_word_embeddings is not supported yet (a tied weight "
                         "would belong to two layers' buckets)")
    if cfg.dtype == "fp16":
        raise ValueError(f"--zero {cfg.zero} supports --dtype fp32 or bf16 (fp16 loss scaling is "
                         f"only in the non-ZeRO path)")
    if cfg.checkpoint_dir:
        raise ValueError(f"--checkpoint-dir with --zero {cfg.zero} is not supported yet (the "
                         f"optimizer state lives in flat ZeRO shards)")
    if cfg.zero == 3 and cfg.save_model:
        raise ValueError("--save-model with --zero 3 is not supported yet (each rank holds only "
                         "a shard of the parameters; use ZeroDataParallel.full_state_dict())")


def _size_buckets(params: list[tuple[str, nn.Parameter]], cap_bytes: float, elsize: int):
    """Split ``params`` (already in backward order) into runs of at most ``cap_bytes``."""
    buckets, cur, size = [], [], 0
    for name, p in params:
        if cur and size + p.numel() * elsize > cap_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, p))
        size += p.numel() * elsize
    if cur:
        buckets.append(cur)
    return buckets


def zero3_units(module: nn.Module) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """Stage-3 buckets in forward order: each ``layers.<i>`` block whole, and every other module
    that owns parameters directly (embedding, final norm, LM head) as its own unit."""
    units, claimed = [], []
    for name, m in module.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        if re.search(r"(^|\.)layers\.\d+$", name):
            claimed.append(name)
            ps = [(f"{name}.{n}", p) for n, p in m.named_parameters()]
        else:
            ps = [(f"{name}.{n}" if name else n, p) for n, p in m.named_parameters(recurse=False)]
        if ps:
            units.append((name, m, ps))
    return units


class ZeroDataParallel(nn.Module):
    """Data parallelism with ZeRO ``stage`` (1, 2 or 3) over ``mesh.groups["dp"]``.

    Follows the trainer's LocalModule protocol: ``forward(*args)`` runs ``module``;
    ``no_sync()``; ``finish_grad_sync()`` (after the last backward of a step: every gradient
    reduced, divided by N, in this rank's shard); ``grad_tensors()`` (the gradient buffers this
    rank holds). ``dtype="bf16"`` stores parameters and gradients in bf16 (fp32 masters live in
    :class:`ZeroOptimizer`). ``bucket_mb``: stage 1/2 bucket size in MiB of parameters.
    ``events`` lists the first ``max_events`` collectives issued (op, unit, phase, time).
    """

    def __init__(self, module: nn.Module, mesh, stage: int, dtype: str = "fp32",
                 bucket_mb: float = 25.0):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage {stage}: expected 1, 2 or 3")
        self.module, self.stage = module, stage
        self.group = mesh.groups.get("dp")
        self.world = comm.group_size(self.group)
        rank = dist.get_rank(self.group) if self.world > 1 else 0
        self.compute_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        device = next(module.parameters()).device
        self.param_names = [n for n, _ in module.named_parameters()]
        self.events: list[dict] = []
        self.max_events = 2000
        if stage == 3:
            units = zero3_units(module)
            groups = [(name or "root", ps) for name, _, ps in units]
        else:
            params = list(module.named_parameters())[::-1]   # backward order
            groups = [(f"bucket{i}", ps) for i, ps in enumerate(
                _size_buckets(params, bucket_mb * 2**20, torch.finfo(self.compute_dtype).bits // 8))]
        self.buckets = [FlatBucket(name, ps, self.world, rank, self.compute_dtype, device)
                        for name, ps in groups]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._pending: list = []      # in-flight reduce-scatters: (bucket, out, work, staging)
        self._next_launch = 0
        self._gathering: dict[int, object] = {}
        if stage == 1:
            for b in self.buckets:
                b.grad_full = torch.zeros_like(b.full)
                b.attach_grads(b.grad_full)
        else:
            for b in self.buckets:
                b.grad_shard = torch.zeros(b.shard_numel, dtype=self.compute_dtype, device=device)
                for p in b.params:
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(self._on_grad)
        if stage == 3:
            # Stage-3 bucket order for gradients is backward order: the reverse of forward.
            self.units = self.buckets
            self.buckets = self.buckets[::-1]
            for i, ((name, m, _), b) in enumerate(zip(units, self.units)):
                # Like FSDP1's FlatParameter: the shard is a registered parameter of its unit, so
                # model.parameters() (and the trainer's byte count) sees what the rank holds.
                m.register_parameter("flat_param_shard", nn.Parameter(b.make_local_shard(),
                                                                      requires_grad=False))
                b.local_shard = m.flat_param_shard
                b.free()
                m.register_forward_pre_hook(functools.partial(self._pre_forward, i))
                m.register_forward_hook(functools.partial(self._post_forward, i))

    # --- LocalModule protocol -------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Stage 1 reduces once per step anyway; stages 2/3 reduce every micro-batch."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def finish_grad_sync(self):
        """Reduce-scatter what is left, wait, and divide the gradient shards by N."""
        if self.stage == 1:
            for b in self.buckets:
                out = torch.empty(b.shard_numel, dtype=b.grad_full.dtype, device=b.grad_full.device)
                self._log("reduce_scatter", b.name, "step")
                comm.reduce_scatter_tensor(out, b.grad_full, group=self.group)
                a, e = b.shard_range
                b.grad_full[a:e].copy_(out.div_(self.world))
            return
        if self._next_launch:
            for b in self.buckets[self._next_launch:]:
                if b.grad_full is None:
                    b.grad_full = b.grad_shard.new_zeros(b.padded)
                self._launch(b, "flush")
            self._next_launch = 0
        while self._pending:
            self._retire()
        for b in self.buckets:
            if self.world > 1:
                b.grad_shard.div_(self.world)
            if self.stage == 3:
                b.free()

    def grad_tensors(self) -> list[torch.Tensor]:
        """Gradient buffers held by this rank: full flat buffers (stage 1) or shards (2, 3)."""
        return [b.grad_full if self.stage == 1 else b.grad_shard for b in self.buckets]

    @torch.no_grad()
    def zero_grad_buffers(self):
        for b in self.buckets:
            if self.stage == 1:
                b.grad_full.zero_()
                b.attach_grads(b.grad_full)
            else:
                b.grad_shard.zero_()

    def grad_shard(self, b: FlatBucket) -> torch.Tensor:
        """The reduced gradient of bucket ``b``'s shard (after ``finish_grad_sync``)."""
        if self.stage == 1:
            a, e = b.shard_range
            return b.grad_full[a:e]
        return b.grad_shard

    # --- stages 2 and 3: gradients ----------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter):
        b = self._bucket_of[id(p)]
        if b.grad_full is None:
            b.grad_full = torch.zeros(b.padded, dtype=p.grad.dtype, device=p.grad.device)
        b.copy_grad_in(p, b.grad_full)
        p.grad = None                     # the full gradient of this parameter is gone
        b.num_ready += 1
        if b.num_ready == b.num_grads:
            if self.stage == 3:
                b.free()
            # Launch in bucket order, identical on every rank.
            while self._next_launch < len(self.buckets) and \
                    self.buckets[self._next_launch].num_ready >= self.buckets[self._next_launch].num_grads:
                self._launch(self.buckets[self._next_launch], "backward")
                self._next_launch += 1
            if self._next_launch == len(self.buckets):
                self._next_launch = 0

    def _launch(self, b: FlatBucket, phase: str):
        out = torch.empty(b.shard_numel, dtype=b.grad_full.dtype, device=b.grad_full.device)
        self._log("reduce_scatter", b.name, phase)
        work = comm.reduce_scatter_tensor(out, b.grad_full, group=self.group, async_op=True)
        self._pending.append((b, out, work, b.grad_full))
        b.grad_full, b.num_ready = None, 0
        while len(self._pending) > 2:     # at most two buckets in flight: bounded memory
            self._retire()

    def _retire(self):
        b, out, work, _staging = self._pending.pop(0)
        if work is not None:
            work.wait()
        b.grad_shard.add_(out)

    # --- stage 3: parameters ----------------------------------------------------------------
    @torch.no_grad()
    def _gather(self, i: int, phase: str, wait: bool = True):
        b = self.units[i]
        if not b.is_full and i not in self._gathering:
            b.allocate()
            self._log("all_gather", b.name, phase)
            self._gathering[i] = comm.all_gather_into_tensor(b.alias, b.local_shard.detach(),
                                                             group=self.group, async_op=True)
        if wait and i in self._gathering:
            work = self._gathering.pop(i)
            if work is not None:
                work.wait()

    def _pre_forward(self, i, module, args):
        self._gather(i, "forward")
        if i + 1 < len(self.units):
            self._gather(i + 1, "forward", wait=False)      # prefetch the next layer

    def _post_forward(self, i, module, args, output):
        self.units[i].free()              # a prefetch of layer i + 1 may still be in flight
        if torch.is_grad_enabled():
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, i))
                    break
        return output

    def _pre_backward(self, i, grad):
        self._gather(i, "backward")
        if i > 0:
            self._gather(i - 1, "backward", wait=False)     # prefetch the previous layer
        return None

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{name: fp32 tensor}`` of the full model (collective over the dp group on stage 3)."""
        if self.stage == 3:
            for i in range(len(self.units)):
                self._gather(i, "state_dict")
        params = dict(self.module.named_parameters())
        out = {n: params[n].detach().float().clone() for n in self.param_names}
        if self.stage == 3:
            for b in self.units:
                b.free()
        return out

    def _log(self, op, unit, phase):
        if len(self.events) < self.max_events:      # bounded: a long run keeps the first ones
            self.events.append({"op": op, "unit": unit, "phase": phase, "t": time.perf_counter()})


class ZeroOptimizer:
    """The optimizer of this rank's shard (``make_optimizer`` builds it, e.g. AdamW).

    Masters: the fp32 shard itself (fp32, no offload), or an fp32 copy of it (bf16 compute, or
    ``cpu_offload``: then on the host, pinned when the parameters are on CUDA). ``state`` exposes
    the inner optimizer's state plus any separate master copy, so
    :func:`llmlab.metrics.memory.optimizer_state_bytes` counts exactly what the rank holds.
    ``step()`` updates the shard and (stages 1, 2) all-gathers the new parameters.
    """

    def __init__(self, wrapper: ZeroDataParallel, make_optimizer, cpu_offload: bool = False):
        self.wrapper = wrapper
        self.masters, self.separate = [], []
        for b in wrapper.buckets:
            shard = b.local_shard if wrapper.stage == 3 else b.shard_view()
            if shard.dtype == torch.float32 and not cpu_offload:
                m = shard if isinstance(shard, nn.Parameter) else nn.Parameter(shard, requires_grad=False)
                self.separate.append(False)
            else:
                host = torch.device("cpu") if cpu_offload else shard.device
                m = shard.detach().to(host, torch.float32, copy=True)
                if cpu_offload and shard.device.type == "cuda":
                    m = m.pin_memory()
                m = nn.Parameter(m, requires_grad=False)
                self.separate.append(True)
            self.masters.append(m)
        self.optimizer = make_optimizer(self.masters)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        st = {}
        for m, sep in zip(self.masters, self.separate):
            st[m] = dict(self.optimizer.state.get(m, {})) | ({"master_param": m} if sep else {})
        return st

    @torch.no_grad()
    def step(self):
        w = self.wrapper
        for b, m in zip(w.buckets, self.masters):
            g = w.grad_shard(b)
            # (a device-to-host copy must be complete before Adam reads it: blocking)
            m.grad = g if (g.dtype == m.dtype and g.device == m.device) else \
                g.to(device=m.device, dtype=torch.float32)
        self.optimizer.step()
        for b, m, sep in zip(w.buckets, self.masters, self.separate):
            if sep:
                target = b.local_shard if w.stage == 3 else b.shard_view()
                target.copy_(m.to(target.device, non_blocking=True))
            m.grad = None
        if w.stage < 3:
            for b in w.buckets:
                w._log("all_gather", b.name, "step")
                comm.all_gather_into_tensor(b.alias, b.shard_view(), group=w.group)

    def zero_grad(self, set_to_none: bool = True):
        self.wrapper.zero_grad_buffers()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [m.detach().cpu().clone() for m in self.masters]}

    def load_state_dict(self, sd: dict):
        self.optimizer.load_state_dict(sd["optimizer"])
        with torch.no_grad():
            for m, v in zip(self.masters, sd["masters"]):
                m.copy_(v)


def build_zero(module: nn.Module, mesh, cfg, make_optimizer):
    """The trainer's hook: ``(ZeroDataParallel, ZeroOptimizer)`` for ``cfg.zero``/``cfg.dtype``.

    ``module`` is this rank's full replica (already on its device, fp32); ``make_optimizer``
    builds the torch optimizer from a list of tensors (the fp32 shard masters).
    """
    wrapper = ZeroDataParallel(module, mesh, stage=cfg.zero, dtype=cfg.dtype, bucket_mb=cfg.bucket_mb)
    return wrapper, ZeroOptimizer(wrapper, make_optimizer, cpu_offload=cfg.cpu_offload)
