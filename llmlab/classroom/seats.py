"""Sharing one node among a room of learners: how many fit, and which devices each one gets.

A *seat* is what one learner's Jupyter server may use: a disjoint set of GPUs (handed over as
``CUDA_VISIBLE_DEVICES``, so each learner's labs see their GPUs as ``cuda:0..g-1``) and a
disjoint set of CPU cores (the server pins itself to them, see :mod:`llmlab.classroom.singleuser`,
and every kernel and rank it starts inherits the affinity). :func:`plan_room` computes the seats
from the node's inventory (what ``llmlab doctor`` reports: :func:`node_inventory`) and the labs'
sizes (:data:`llmlab.lab_sizes.LAB_SIZES`): a learner gets as many GPUs as the largest
``min_ranks`` among the labs taught, so that each of those labs runs on its GPUs instead of falling
back to CPU ranks (:func:`llmlab.runtime.hardware.lab_size`); on a CPU-only node, as many cores.
:class:`SeatAllocator` hands seats to learners as their servers start and takes them back when
they stop (the hub's ``pre_spawn_hook`` / ``post_stop_hook``, ``classroom/jupyterhub_config.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Seat:
    """One learner's share of the node. ``gpus``: device ids as the hub sees them (entries of its
    own ``CUDA_VISIBLE_DEVICES`` when it has one); ``cores``: CPU core ids; ``mem_bytes``: the
    learner's share of the node's RAM (bytes)."""

    index: int
    gpus: tuple[str, ...]
    cores: tuple[int, ...]
    mem_bytes: int

    def environment(self, node_has_gpus: bool) -> dict[str, str]:
        """The variables the learner's server starts with: ``CUDA_VISIBLE_DEVICES`` (empty on a
        seat without GPUs of a GPU node, so no GPU is shared by accident), the cores to pin to
        (``LLMLAB_CPU_CORES``) and the thread counts of OpenMP/MKL (one per core)."""
        env = {
            "LLMLAB_SEAT": str(self.index),
            "LLMLAB_CPU_CORES": ",".join(map(str, self.cores)),
            "OMP_NUM_THREADS": str(len(self.cores)),
            "MKL_NUM_THREADS": str(len(self.cores)),
        }
        if node_has_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return env


@dataclass
class RoomPlan:
    """How a node is shared: ``learners`` seats of ``gpus_per_learner`` GPUs and
    ``cores_per_learner`` cores each (``seats``), and why (``reason``)."""

    learners: int
    gpus_per_learner: int
    cores_per_learner: int
    node_gpus: int
    seats: list[Seat] = field(default_factory=list)
    reason: str = ""

    def describe(self) -> str:
        each = (
            f"{self.gpus_per_learner} GPU{'s' if self.gpus_per_learner != 1 else ''} and "
            if self.node_gpus
            else ""
        )
        return (
            f"{self.learners} learner{'s' if self.learners != 1 else ''} on this node, "
            f"{each}{self.cores_per_learner} CPU core{'s' if self.cores_per_learner != 1 else ''} "
            f"each ({self.reason})"
        )


def node_inventory() -> dict:
    """What ``llmlab doctor`` reports about this machine (:func:`llmlab.runtime.hardware.hardware`: ``cpu_cores``,
    ``gpus`` with ``index`` and ``memory_bytes``), plus ``usable_cores`` (this process's affinity
    set) and ``memory_bytes`` (RAM)."""
    import psutil

    from llmlab.runtime.hardware import hardware

    inv = hardware()
    inv["usable_cores"] = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    inv["memory_bytes"] = psutil.virtual_memory().total
    return inv


def ranks_per_learner(labs: list[str] | None = None) -> tuple[int, str]:
    """The devices one learner needs so that every lab in ``labs`` (default: all of
    :data:`~llmlab.lab_sizes.LAB_SIZES`) runs at its smallest size on them: the largest
    ``min_ranks``, and the lab that sets it. Raises ``KeyError`` naming the labs for an unknown one."""
    from llmlab.lab_sizes import LAB_SIZES

    labs = list(LAB_SIZES) if labs is None else labs
    unknown = [lab for lab in labs if lab not in LAB_SIZES]
    if unknown:
        raise KeyError(f"no lab named {', '.join(unknown)}; labs: {', '.join(LAB_SIZES)}")
    need = {lab: LAB_SIZES[lab].get("min_ranks", 1) for lab in labs}
    lab = max(need, key=lambda k: need[k])
    return need[lab], lab


def plan_room(
    inventory: dict,
    labs: list[str] | None = None,
    gpus_per_learner: int | None = None,
    cores_per_learner: int | None = None,
) -> RoomPlan:
    """Share the node of ``inventory`` (:func:`node_inventory`) among learners.

    GPU node with G GPUs: each learner gets ``gpus_per_learner`` (default: :func:`ranks_per_learner`
    of ``labs``, at most G) disjoint GPUs, so G // that learners, and the usable cores divided
    evenly among them. CPU-only node with C usable cores: ``cores_per_learner`` (default: the same
    rank count; each gloo rank wants a core) disjoint cores each, so C // that learners, at least
    one (who then gets every core). RAM is divided evenly. Raises ``ValueError`` when the node has
    fewer GPUs than ``gpus_per_learner`` asks, or for a count below 1.
    """
    need, lab = ranks_per_learner(labs)
    cores = list(inventory.get("usable_cores") or range(inventory["cpu_cores"]))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g.strip() for g in visible.split(",") if g.strip()] if visible else None
    gpus = [ids[g["index"]] if ids else str(g["index"]) for g in inventory.get("gpus", [])]
    for name, v in (("gpus_per_learner", gpus_per_learner), ("cores_per_learner", cores_per_learner)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if gpus:
        per = gpus_per_learner or min(need, len(gpus))  # a node with fewer: one learner, every GPU
        if per > len(gpus):
            raise ValueError(
                f"{per} GPUs per learner but this node has {len(gpus)}: set "
                f"gpus_per_learner (LLMLAB_HUB_GPUS_PER_LEARNER) to at most {len(gpus)}"
            )
        learners = len(gpus) // per
        core_each = cores_per_learner or max(1, len(cores) // learners)
        learners = min(learners, max(1, len(cores) // core_each))
        why = f"{len(gpus)} GPUs / {per} per learner" + (
            "" if gpus_per_learner else f", lab {lab} needs {need} ranks"
        )
    else:
        per = 0
        core_each = min(cores_per_learner or need, len(cores))
        learners = max(1, len(cores) // core_each)
        why = f"{len(cores)} CPU cores / {core_each} per learner" + (
            "" if cores_per_learner else f", lab {lab} runs {need} gloo ranks"
        )
    mem = int(inventory.get("memory_bytes", 0)) // learners
    seats = [
        Seat(i, tuple(gpus[i * per : (i + 1) * per]), tuple(cores[i * core_each : (i + 1) * core_each]), mem)
        for i in range(learners)
    ]
    return RoomPlan(learners, per, core_each, len(gpus), seats, why)


class SeatAllocator:
    """Which learner holds which seat of a :class:`RoomPlan`, in the hub's process: :meth:`take`
    when a server starts, :meth:`release` when it stops. A learner who restarts gets a free seat
    again (their old one if still free); nobody shares one."""

    def __init__(self, plan: RoomPlan):
        self.plan = plan
        self.holders: dict[str, int] = {}

    def take(self, learner: str) -> Seat:
        """The seat for ``learner``'s server. Raises ``RuntimeError`` when every seat is held."""
        if learner in self.holders:
            return self.plan.seats[self.holders[learner]]
        held = set(self.holders.values())
        free = [s for s in self.plan.seats if s.index not in held]
        if not free:
            raise RuntimeError(
                f"the room is full: all {self.plan.learners} seats of this node are "
                f"in use ({', '.join(sorted(self.holders))}); try again when one stops"
            )
        self.holders[learner] = free[0].index
        return free[0]

    def release(self, learner: str) -> None:
        self.holders.pop(learner, None)
