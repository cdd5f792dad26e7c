"""Ray as the distributed executor (``distributed_executor_backend="ray"``): the workers of
:mod:`llmlab.inference.pipeline_parallel` as Ray actors placed on a Ray cluster.

The cluster comes first, as the source articles (and vLLM) deploy it::

    ray start --head --port 6379                      # on the head node
    ray start --address HEAD:6379                     # on every other node
    RAY_ADDRESS=HEAD:6379 llmlab serve --distributed-executor-backend ray \\
        --tensor-parallel-size 2 --pipeline-parallel-size 2       # on the head

Placement (Ray placement groups): one bundle per pipeline stage holding the stage's ``tp`` ranks
(a bundle lives on one node, so the ranks of a stage share a node and its fast links: Ray's
``STRICT_PACK`` for each stage), the bundles on distinct nodes when the cluster has as many
(``STRICT_SPREAD``; else ``PACK``), so the pipeline's point-to-point traffic is what crosses nodes.
Each replica (``--data-parallel-size``) gets its own placement group, wherever it fits. The actors
talk with ``torch.distributed`` (gloo on CPU, NCCL on GPUs) over a rendezvous store this process
hosts on the address the cluster reaches it by; the engine (scheduler, sampling) and the HTTP
server stay in this process; each step goes to every actor as a Ray call, the logits come back
as the last stage's reply.

Bad input, before any worker starts: no cluster at ``RAY_ADDRESS`` (:func:`connect`), more workers
than the cluster has CPUs (or GPUs) for, or a stage larger than any node (:func:`check_capacity`),
a placement group not ready within :data:`PLACEMENT_TIMEOUT_S` (it is removed): each a
``ValueError`` naming the sizes. A worker that dies (its node lost) fails the step with
:class:`~llmlab.inference.errors.EngineDeadError` as soon as Ray reports it (``ray start``'s
``RAY_health_check_*`` settings bound how long a lost node takes to be declared dead); the actors
and placement group are killed and removed on shutdown, or when starting fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import sys
import uuid
from typing import Any

import torch

from llmlab.inference.errors import EngineDeadError
from llmlab.runtime import process

PLACEMENT_TIMEOUT_S = float(os.environ.get("LLMLAB_RAY_PLACEMENT_TIMEOUT", "30"))


def _ray() -> Any:
    try:
        import ray
    except ModuleNotFoundError:
        raise NotImplementedError(
            "distributed_executor_backend='ray' needs Ray: pip install 'llmlab[cluster]' (or pip install ray)"
        ) from None
    return ray


def connect(address: str | None = None) -> Any:
    """Join the Ray cluster at ``address`` (default ``$RAY_ADDRESS``, else the one started on this
    node) once per process; returns the ``ray`` module. Raises ``ValueError`` when there is none."""
    ray = _ray()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or "auto"
        _check_reachable(address)
        try:
            ray.init(address=address, logging_level="WARNING", configure_logging=True)
        except (ConnectionError, RuntimeError) as e:
            raise ValueError(
                f"no Ray cluster at {address!r} ({type(e).__name__}: {e}); start one "
                "with `ray start --head` (and `ray start --address HEAD:PORT` on the "
                "other nodes), then set RAY_ADDRESS=HEAD:PORT"
            ) from None
    return ray


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Raise ``ValueError`` at once when nothing listens at ``address`` (``host:port``; Ray itself
    would retry for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto": ray.init looks on this node itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ValueError(
            f"no Ray cluster at {address!r}: {e.strerror or e}; start one with "
            "`ray start --head` (and `ray start --address HEAD:PORT` on the other "
            "nodes), then set RAY_ADDRESS=HEAD:PORT"
        ) from None


def _resource(device: torch.device) -> str:
    return "GPU" if device.type == "cuda" else "CPU"


def check_capacity(tp: int, pp: int, replicas: int = 1, device: str | torch.device = "cpu") -> None:
    """Raise ``ValueError`` when the cluster cannot hold ``replicas`` x ``pp`` stages of ``tp``
    workers (one CPU, or one GPU, each): too few in all, or no node with room for one stage."""
    ray = connect()
    dev = torch.device(
        "cuda"
        if str(device) in ("auto", "cuda") and torch.cuda.is_available()
        else str(device)
        if str(device) != "auto"
        else "cpu"
    )
    res = _resource(dev)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    have = [float(n["Resources"].get(res, 0)) for n in nodes]
    need = tp * pp * replicas
    sizes = f"{replicas} replica(s) x pipeline_parallel_size {pp} x tensor_parallel_size {tp}"
    if sum(have) < need:
        raise ValueError(
            f"{sizes} = {need} workers need {need} {res}s, but the Ray cluster has "
            f"{sum(have):g} ({len(nodes)} node(s): {', '.join(f'{h:g}' for h in have)}); "
            "add nodes or lower the sizes"
        )
    if max(have, default=0) < tp:
        raise ValueError(
            f"the {tp} ranks of a pipeline stage go on one node, but no node of the "
            f"Ray cluster has {tp} {res}s (nodes: {', '.join(f'{h:g}' for h in have)})"
        )


def reach_address(gcs_address: str) -> str:
    """This machine's address on the route to ``gcs_address`` (``ip:port``): the one the cluster's
    nodes reach it by."""
    host, _, port = gcs_address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port or 6379)))
        addr: str = s.getsockname()[0]  # (host, port) of an AF_INET socket
        return addr


def interface_of(ip: str) -> str | None:
    """The name of the network interface holding IPv4 address ``ip`` (loopback for 127.x), or None."""
    if ip.startswith("127."):
        return process.loopback_interface()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:  # SIOCGIFADDR: no IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


class StageActor:
    """A Ray actor holding one rank of the pipeline (:func:`~llmlab.inference.pipeline_parallel.build_stage`)."""

    def setup(
        self,
        build: Any,
        rank: int,
        tp: int,
        pp: int,
        host: str,
        port: int,
        backend: str,
        weights: Any,
        config: Any,
        runner_args: dict[str, Any],
        device: str,
    ) -> str:
        """Join the process group on ``host:port`` (gloo on the interface of this node's Ray
        address, unless ``GLOO_SOCKET_IFNAME`` is set) and build the stage with ``build``
        (:func:`~llmlab.inference.pipeline_parallel.build_stage`); returns this node's address."""
        ray = _ray()
        ip: str = ray.util.get_node_ip_address()
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            name = interface_of(ip)
            if name is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = name
        torch.set_num_threads(1)
        dev = torch.device(device)
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU
            dev = torch.device("cuda", 0)
        process.init_process_group(backend, process.join_store(host, port), rank, tp * pp)
        self.runner = build(rank, tp, pp, weights, config, runner_args, dev)
        return ip

    def execute(self, msg: dict[str, Any]) -> Any:
        return self.runner.execute_message(msg)


class RayWorkers:
    """``tp * pp`` :class:`StageActor` s in one placement group (see the module docstring), with the
    :class:`~llmlab.inference.pipeline_parallel.ProcessWorkers` interface: ``submit``, ``result``,
    ``close``. ``nodes[r]``: the address of rank ``r``'s node."""

    def __init__(self, ray: Any, actors: list[Any], group: Any, store: Any, tp: int, pp: int) -> None:
        self.ray, self.actors, self.group, self._store = ray, actors, group, store
        self.tp, self.pp = tp, pp
        self.output_rank = (pp - 1) * tp
        self.nodes: list[str] = []
        self._closed = False

    @classmethod
    def start(
        cls,
        build: Any,
        weights: Any,
        config: Any,
        tp: int,
        pp: int,
        runner_args: dict[str, Any],
        device: torch.device,
    ) -> RayWorkers:
        """Place and start the actors; each builds its stage with ``build`` (see
        :meth:`StageActor.setup`). Raises ``ValueError`` (see the module docstring)."""
        ray = connect()
        check_capacity(tp, pp, 1, device)
        from ray.util.placement_group import placement_group

        res = _resource(device)
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        strategy = "STRICT_SPREAD" if 1 < pp <= alive else "PACK"
        group = placement_group(
            [{res: float(tp)}] * pp, strategy=strategy, name=f"llmlab-{uuid.uuid4().hex[:8]}"
        )
        workers = cls(ray, [], group, None, tp, pp)
        try:
            workers._place(strategy)
            workers._start_actors(build, weights, config, runner_args, device)
        except BaseException:
            workers.close()
            raise
        return workers

    def _place(self, strategy: str) -> None:
        try:
            self.ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise ValueError(
                f"the Ray cluster could not place {self.pp} stage(s) of "
                f"{self.tp} worker(s) ({strategy}: a stage's workers on one node"
                f"{', stages on distinct nodes' if strategy == 'STRICT_SPREAD' else ''})"
                f" within {PLACEMENT_TIMEOUT_S:g} s; add nodes or lower the sizes "
                "(LLMLAB_RAY_PLACEMENT_TIMEOUT sets the wait)"
            ) from None

    def _start_actors(
        self, build: Any, weights: Any, config: Any, runner_args: dict[str, Any], device: torch.device
    ) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, tp, pp = self.ray, self.tp, self.pp
        backend = process.resolve_backend("auto", None, device=device.type)
        host = reach_address(ray.get_runtime_context().gcs_address)
        self._store = process.loopback_store(host)
        if not isinstance(weights, str):
            weights = ray.put(weights)
        opts = {"num_gpus": 1, "num_cpus": 0} if device.type == "cuda" else {"num_cpus": 1}
        actor = ray.remote(**opts)(StageActor)
        for r in range(tp * pp):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=r // tp)
            self.actors.append(actor.options(scheduling_strategy=strategy).remote())
        refs = [
            a.setup.remote(
                build, r, tp, pp, host, self._store.port, backend, weights, config, runner_args, device.type
            )
            for r, a in enumerate(self.actors)
        ]
        self.nodes = self.result(refs, all_values=True)
        print(
            "llmlab: Ray placement: "
            + "; ".join(
                f"stage {s} ranks {s * tp}-{s * tp + tp - 1} on {', '.join(sorted(set(self.nodes[s * tp : (s + 1) * tp])))}"
                for s in range(pp)
            ),
            file=sys.stderr,
            flush=True,
        )

    def submit(self, msg: dict[str, Any]) -> list[Any]:
        ref = self.ray.put(msg)
        return [a.execute.remote(ref) for a in self.actors]

    def result(self, refs: list[Any], all_values: bool = False) -> Any:
        """Wait for every rank's reply to one call; the last stage's rank 0's (or, with
        ``all_values``, all of them). A rank that failed or died raises :class:`EngineDeadError`
        at once, naming it and its node."""
        ray, pending, values = self.ray, list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                r = refs.index(ref)
                try:
                    values[r] = ray.get(ref)
                except Exception as e:
                    where = f" on node {self.nodes[r]}" if r < len(self.nodes) else ""
                    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                    raise EngineDeadError(
                        f"pipeline-parallel rank {r} (Ray actor){where} failed: "
                        f"{type(e).__name__}: {first}; the engine cannot step"
                    ) from e
        return [values[r] for r in range(len(refs))] if all_values else values.get(self.output_rank)

    def close(self) -> None:
        """Kill the actors and remove the placement group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            with contextlib.suppress(Exception):  # gone already
                self.ray.kill(a)
        with contextlib.suppress(Exception):  # the cluster is gone
            remove_placement_group(self.group)
        self._store = None
