"""The device mesh: data-, context-, tensor-, pipeline- and expert-parallel process groups.

Ranks are laid out in Megatron-LM's order, tensor-parallel fastest, then context-parallel, then
data-parallel, then pipeline (Narayanan et al. 2021, §3.3: TP inside a node, where bandwidth is
highest; Megatron core's ``tp-cp-ep-dp-pp`` order)::

    rank = pp_idx * (dp * cp * tp) + dp_idx * (cp * tp) + cp_idx * tp + tp_idx

Context-parallel ranks (``cp``) hold different tokens of the same sequences with the same weights,
so gradients are reduced over data *and* context parallelism: the ``dp_cp`` group, which
:meth:`Mesh.data_parallel_view` hands to DDP and ZeRO as their ``dp`` group (ZeRO then shards over
``dp*cp`` ranks, as Megatron's distributed optimizer does).

Expert-parallel groups are carved out of the data-parallel ranks, as in Megatron core: within
one (pp, tp) coordinate the ``dp`` ranks form ``dp/ep`` groups of ``ep`` consecutive data-parallel
ranks. Experts are sharded over an EP group; each expert's gradients are reduced over the
*expert-data-parallel* group (same expert shard, other EP groups), dense weights over ``dp``.

The mesh is an ordinary object passed to whoever needs it (no global state), so a notebook can
build several layouts in one kernel.
"""

from __future__ import annotations

from typing import Any

import dataclasses
import functools
from dataclasses import dataclass, field

import torch.distributed as dist

from llmlab.runtime.process import pg_timeout


def check_degrees(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> None:
    """Raise ``ValueError`` naming the constraint if the degrees cannot form a mesh."""
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if dp * cp * tp * pp != world_size:
        if cp == 1:
            raise ValueError(
                f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} must equal the world size {world_size}"
            )
        raise ValueError(
            f"dp*cp*tp*pp = {dp}*{cp}*{tp}*{pp} = {dp * cp * tp * pp} must equal the world size {world_size}"
        )
    if dp % ep:
        raise ValueError(
            f"ep={ep} must divide dp={dp} (expert-parallel groups are carved out of the data-parallel ranks)"
        )


def rank_of(dp_idx: int, tp_idx: int, pp_idx: int, dp: int, tp: int, cp_idx: int = 0, cp: int = 1) -> int:
    return pp_idx * dp * cp * tp + dp_idx * cp * tp + cp_idx * tp + tp_idx


@dataclass
class Mesh:
    """Process groups and coordinates of this rank.

    Attributes: degrees ``dp, tp, pp, ep, cp``; ``rank``; ``coords`` (``{"dp","tp","pp","ep","cp"}``);
    ``groups[name]`` and ``ranks[name]`` for ``dp, tp, pp, ep, edp, cp, dp_cp`` (edp =
    expert-data-parallel; dp_cp = the data- and context-parallel ranks that reduce gradients).
    Every group is a real process group, also when it has a single rank (collectives on it are
    then no-ops in :mod:`llmlab.runtime.comm`); groups are ``None`` only without
    ``torch.distributed`` (a plain single process). Never pass ``None`` for a mesh group to a
    collective inside a multi-rank job: ``None`` means the whole world.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    rank: int = 0
    coords: dict[str, int] = field(default_factory=lambda: {"dp": 0, "tp": 0, "pp": 0, "ep": 0, "cp": 0})
    groups: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def build(cls, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> "Mesh":
        """Create every group; all ranks must call this collectively, in the same order.

        Without an initialised process group only the trivial 1x1x1x1 mesh is allowed.
        Raises ``ValueError`` if the degrees do not fit the world size.
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        check_degrees(world, dp, tp, pp, ep, cp)
        mesh = cls(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, rank=rank)
        pp_idx, rem = divmod(rank, dp * cp * tp)
        dp_idx, rem = divmod(rem, cp * tp)
        cp_idx, tp_idx = divmod(rem, tp)
        mesh.coords = {"dp": dp_idx, "tp": tp_idx, "pp": pp_idx, "ep": dp_idx % ep, "cp": cp_idx}
        R = functools.partial(rank_of, dp=dp, tp=tp, cp=cp)
        every = [(p, c, t) for p in range(pp) for c in range(cp) for t in range(tp)]
        families = {
            "tp": [
                [R(d, t, p, cp_idx=c) for t in range(tp)]
                for p in range(pp)
                for d in range(dp)
                for c in range(cp)
            ],
            "dp": [[R(d, t, p, cp_idx=c) for d in range(dp)] for p, c, t in every],
            "pp": [
                [R(d, t, p, cp_idx=c) for p in range(pp)]
                for d in range(dp)
                for c in range(cp)
                for t in range(tp)
            ],
            "ep": [
                [R(g * ep + e, t, p, cp_idx=c) for e in range(ep)]
                for p, c, t in every
                for g in range(dp // ep)
            ],
            "edp": [
                [R(g * ep + e, t, p, cp_idx=c) for g in range(dp // ep)]
                for p, c, t in every
                for e in range(ep)
            ],
            "cp": [
                [R(d, t, p, cp_idx=c) for c in range(cp)]
                for p in range(pp)
                for d in range(dp)
                for t in range(tp)
            ],
            "dp_cp": [
                [R(d, t, p, cp_idx=c) for d in range(dp) for c in range(cp)]
                for p in range(pp)
                for t in range(tp)
            ],
        }
        for name, lists in families.items():
            for members in lists:
                # new_group is collective over the whole world, even for groups we are not in.
                # Groups of one rank are created too: ``None`` would mean the *world* group.
                # Each times out as the world does (LLMLAB_PG_TIMEOUT; new_group's own default
                # is 30 min): a hung peer fails the job's collectives, not only the world's.
                g = dist.new_group(members, timeout=pg_timeout()) if dist.is_initialized() else None
                if rank in members:
                    mesh.groups[name], mesh.ranks[name] = g, members
        return mesh

    def data_parallel_view(self) -> "Mesh":
        """The mesh as gradient reduction sees it: with ``cp > 1``, data and context parallelism
        folded into one ``dp`` of ``dp*cp`` ranks (group ``dp_cp``); ``self`` when ``cp == 1``.

        Context-parallel ranks hold replicas of the same weights, and each computes gradients
        of the loss on its own tokens, so DDP's average (or ZeRO's reduce-scatter) over
        ``dp_cp`` gives the gradient of the global batch's mean loss.
        """
        if self.cp == 1:
            return self
        view = dataclasses.replace(
            self,
            dp=self.dp * self.cp,
            cp=1,
            coords=dict(self.coords),
            groups=dict(self.groups),
            ranks=dict(self.ranks),
        )
        view.coords["dp"] = self.index("dp_cp")
        view.coords["cp"] = 0
        if "dp_cp" in self.groups:
            view.groups["dp"], view.ranks["dp"] = self.groups["dp_cp"], self.ranks["dp_cp"]
        return view

    # --- convenience ----------------------------------------------------------------------
    def size(self, name: str) -> int:
        return len(self.ranks.get(name, [self.rank]))

    def index(self, name: str) -> int:
        return self.ranks.get(name, [self.rank]).index(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        return None if self.is_first_stage else self.ranks["pp"][self.coords["pp"] - 1]

    @property
    def next_stage_rank(self) -> int | None:
        return None if self.is_last_stage else self.ranks["pp"][self.coords["pp"] + 1]

    def describe(self) -> str:
        c = self.coords
        return (
            f"rank {self.rank}: dp {c['dp']}/{self.dp} tp {c['tp']}/{self.tp} "
            f"pp {c['pp']}/{self.pp} ep {c['ep']}/{self.ep}"
            + (f" cp {c['cp']}/{self.cp}" if self.cp > 1 else "")
        )
