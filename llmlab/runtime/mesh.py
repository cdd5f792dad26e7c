"""The device mesh: data-, tensor-, pipeline- and expert-parallel process groups.

Ranks are laid out in Megatron-LM's order, tensor-parallel fastest, then data-parallel, then
pipeline (Narayanan et al. 2021, §3.3: TP inside a node, where bandwidth is highest)::

    rank = pp_idx * (dp * tp) + dp_idx * tp + tp_idx

Expert-parallel groups are carved out of the data-parallel ranks, as in Megatron core: within
one (pp, tp) coordinate the ``dp`` ranks form ``dp/ep`` groups of ``ep`` consecutive data-parallel
ranks. Experts are sharded over an EP group; each expert's gradients are reduced over the
*expert-data-parallel* group (same expert shard, other EP groups), dense weights over ``dp``.

The mesh is an ordinary object passed to whoever needs it (no global state), so a notebook can
build several layouts in one kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


def check_degrees(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """Raise ``ValueError`` naming the constraint if the degrees cannot form a mesh."""
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if dp * tp * pp != world_size:
        raise ValueError(f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} must equal the world size "
                         f"{world_size}")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp} (expert-parallel groups are carved out of "
                         f"the data-parallel ranks)")


def rank_of(dp_idx: int, tp_idx: int, pp_idx: int, dp: int, tp: int) -> int:
    return pp_idx * dp * tp + dp_idx * tp + tp_idx


@dataclass
class Mesh:
    """Process groups and coordinates of this rank.

    Attributes: degrees ``dp, tp, pp, ep``; ``rank``; ``coords`` (``{"dp","tp","pp","ep"}``);
    ``groups[name]`` and ``ranks[name]`` for ``dp, tp, pp, ep, edp`` (edp = expert-data-parallel).
    A group is ``None`` when it has a single rank (collectives on it are no-ops).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    rank: int = 0
    coords: dict = field(default_factory=lambda: {"dp": 0, "tp": 0, "pp": 0, "ep": 0})
    groups: dict = field(default_factory=dict)
    ranks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1) -> "Mesh":
        """Create every group; all ranks must call this collectively, in the same order.

        Without an initialised process group only the trivial 1x1x1x1 mesh is allowed.
        Raises ``ValueError`` if the degrees do not fit the world size.
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        check_degrees(world, dp, tp, pp, ep)
        mesh = cls(dp=dp, tp=tp, pp=pp, ep=ep, rank=rank)
        pp_idx, rem = divmod(rank, dp * tp)
        dp_idx, tp_idx = divmod(rem, tp)
        mesh.coords = {"dp": dp_idx, "tp": tp_idx, "pp": pp_idx, "ep": dp_idx % ep}
        families = {
            "tp": [[rank_of(d, t, p, dp, tp) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "dp": [[rank_of(d, t, p, dp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)],
            "pp": [[rank_of(d, t, p, dp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)],
            "ep": [[rank_of(g * ep + e, t, p, dp, tp) for e in range(ep)]
                   for p in range(pp) for t in range(tp) for g in range(dp // ep)],
            "edp": [[rank_of(g * ep + e, t, p, dp, tp) for g in range(dp // ep)]
                    for p in range(pp) for t in range(tp) for e in range(ep)],
        }
        for name, lists in families.items():
            for members in lists:
                # new_group is collective over the whole world, even for groups we are not in.
                g = dist.new_group(members) if dist.is_initialized() and len(members) > 1 else None
                if rank in members:
                    mesh.groups[name], mesh.ranks[name] = g, members
        return mesh

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
        return (f"rank {self.rank}: dp {c['dp']}/{self.dp} tp {c['tp']}/{self.tp} "
                f"pp {c['pp']}/{self.pp} ep {c['ep']}/{self.ep}")
