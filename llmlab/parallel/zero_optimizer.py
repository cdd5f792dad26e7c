"""The ZeRO optimizer: Adam (or any torch optimizer) on this rank's shard only.

ZeRO (Rajbhandari et al. 2020, §5.1, P_os): each data-parallel rank keeps the optimizer states
(and, under 16-bit compute, the fp32 master weights) of its shard of every flat bucket only; after
the update, stages 1 and 2 all-gather the new parameters (stage 3 keeps the shards).
``--cpu-offload`` (ZeRO-Offload, Ren et al. 2021): the masters and moments live in host memory and
the update runs there. The gradient and parameter sharding is :class:`~llmlab.parallel.zero.ZeroDataParallel`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import nn

from llmlab.parallel.protocols import ParamStateLookup
from llmlab.runtime import comm


class LossScaler(Protocol):
    """The fp16 loss scaler (:class:`~llmlab.training.precision.DynamicLossScaler`): its ``scale``."""

    scale: float


class ShardedBuckets(Protocol):
    """What the optimizer reads of the wrapper that shards the gradients and parameters
    (:class:`~llmlab.parallel.zero.ZeroDataParallel`): its public face, nothing private."""

    buckets: list[Any]  # flat buckets: params, offsets, numels, shard_range, alias, group, name
    stage: int  # 1, 2 or 3

    def grad_shard(self, bucket: Any) -> torch.Tensor: ...

    def zero_grad_buffers(self) -> None: ...

    def log_event(self, op: str, unit: str, phase: str) -> None: ...


def _gather_flat(b: Any, shard: torch.Tensor) -> torch.Tensor:
    """Bucket ``b``'s full padded flat tensor from every rank's ``shard`` (collective over the
    bucket's group; bookkeeping: not counted in the comm bytes)."""
    if b.world == 1:
        return shard.detach().clone()
    out = shard.new_empty(b.padded)
    comm.dist_all_gather_single(out, shard.detach().contiguous(), group=b.group)
    return out


class ZeroOptimizer:
    """The optimizer of this rank's shard (``make_optimizer`` builds it, e.g. AdamW).

    Masters: the fp32 shard itself (fp32, no offload), or an fp32 copy of it (16-bit compute, or
    ``cpu_offload``: then on the host, pinned when the parameters are on CUDA). ``state`` exposes
    the inner optimizer's state plus any separate master copy, so
    :func:`llmlab.metrics.memory.optimizer_state_bytes` counts exactly what the rank holds.
    ``unscale(inv_scale)`` hands the reduced gradient shards to the masters (fp32, divided by the
    fp16 loss scale), ``apply()`` updates the shard and (stages 1, 2) all-gathers the new
    parameters; ``step()`` does both.
    """

    def __init__(
        self,
        wrapper: ShardedBuckets,
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        cpu_offload: bool = False,
        scaler: LossScaler | None = None,
    ) -> None:
        self.wrapper, self.scaler = wrapper, scaler
        self.masters: list[nn.Parameter] = []
        self.separate: list[bool] = []
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
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict[nn.Parameter, dict[str, Any]]:
        st: dict[nn.Parameter, dict[str, Any]] = {}
        for m, sep in zip(self.masters, self.separate):
            st[m] = dict(self.optimizer.state.get(m, {})) | ({"master_param": m} if sep else {})
        return st

    @torch.no_grad()
    def unscale(self) -> None:
        """Point every master's ``.grad`` at its reduced gradient shard, in fp32 and divided by
        the fp16 loss scale (the shard itself when it already is fp32 and unscaled)."""
        inv = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        for b, m in zip(self.wrapper.buckets, self.masters):
            g = self.wrapper.grad_shard(b)
            # (a device-to-host copy must be complete before Adam reads it: blocking)
            m.grad = (
                g
                if (g.dtype == m.dtype and g.device == m.device)
                else g.to(device=m.device, dtype=torch.float32)
            )
            if inv != 1.0:
                m.grad = m.grad * inv

    def grad_pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(slice of a master's gradient, model parameter)`` for every parameter element in this
        rank's shards, after :meth:`unscale` (shards of different ranks are disjoint)."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for b, m in zip(self.wrapper.buckets, self.masters):
            lo, hi = b.shard_range
            for p, o, n in zip(b.params, b.offsets, b.numels):
                a, e = max(o, lo), min(o + n, hi)
                if a < e and m.grad is not None:
                    out.append((m.grad[a - lo : e - lo], p))
        return out

    @torch.no_grad()
    def apply(self) -> None:
        w = self.wrapper
        self.optimizer.step()
        for b, m, sep in zip(w.buckets, self.masters, self.separate):
            if sep:
                target = b.local_shard if w.stage == 3 else b.shard_view()
                target.copy_(m.to(target.device, non_blocking=True))
            m.grad = None
        if w.stage < 3:
            for b in w.buckets:
                w.log_event("all_gather", b.name, "step")
                comm.all_gather_into_tensor(b.alias, b.shard_view(), group=b.group)

    def step(self) -> None:
        self.unscale()
        self.apply()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.masters:
            m.grad = None
        self.wrapper.zero_grad_buffers()

    # --- the checkpoint's pair: whole tensors, whatever the shards -------------------------------
    @torch.no_grad()
    def param_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """For every parameter in the buckets: its whole (tp-local) weights (``"param"``, in the
        compute dtype), fp32 master (``"master"``, where it is a separate tensor) and Adam state,
        on the CPU: each bucket's shards all-gathered over its group and cut into parameters
        (:class:`~llmlab.parallel.protocols.TrainerOptimizer`). Collective: every rank calls it.
        The gathers are bookkeeping, not counted in the communication bytes."""
        w, out = self.wrapper, {}
        for b, m, sep in zip(w.buckets, self.masters, self.separate):
            shard = b.local_shard if w.stage == 3 else b.shard_view()
            flats = {"param": _gather_flat(b, shard)}
            if sep:
                flats["master"] = _gather_flat(b, m.to(b.device))
            st = self.optimizer.state.get(m, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    flats[k] = _gather_flat(b, st[k].to(b.device))
            for p, o, n in zip(b.params, b.offsets, b.numels):
                out[p] = {k: f[o : o + n].view(p.shape).to("cpu").clone() for k, f in flats.items()}
                if "step" in st:
                    out[p]["step"] = st["step"].detach().to("cpu").clone().float()
        return out

    @torch.no_grad()
    def load_param_state(self, lookup: ParamStateLookup) -> None:
        """Install whole tensors: each bucket laid out flat from ``lookup(p)`` of its parameters,
        this rank keeping its shard of the masters and Adam moments. The parameters (the whole
        flat buffer under stages 1-2, the shard under stage 3) come from ``"param"`` too, so
        every data-parallel replica holds the same weights."""
        w = self.wrapper
        for b, m in zip(w.buckets, self.masters):
            lo, hi = b.shard_range
            flats: dict[str, torch.Tensor] = {}
            step = None
            for p, o, n in zip(b.params, b.offsets, b.numels):
                st = lookup(p)
                for k in ("param", "exp_avg", "exp_avg_sq"):
                    if k in st:
                        flat = flats.setdefault(k, torch.zeros(b.padded, dtype=torch.float32))
                        flat[o : o + n] = st[k].reshape(-1).float()
                step = st.get("step", step)
            if w.stage == 3:
                b.local_shard.copy_(flats["param"][lo:hi].to(b.local_shard.dtype))
            else:
                b.alias.copy_(flats["param"].to(b.alias.dtype))
            m.copy_(flats["param"][lo:hi].to(m.device, m.dtype))
            if step is not None and "exp_avg" in flats:
                self.optimizer.state[m] = {
                    "step": step.clone().reshape(()),
                    "exp_avg": flats["exp_avg"][lo:hi].clone().to(m.device),
                    "exp_avg_sq": flats["exp_avg_sq"][lo:hi].clone().to(m.device),
                }

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [m.detach().cpu().clone() for m in self.masters],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sd["optimizer"])
        with torch.no_grad():
            for m, v in zip(self.masters, sd["masters"]):
                m.copy_(v)
