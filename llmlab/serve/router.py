"""Data-parallel replicas behind one server: send each request to the least-loaded engine.

The source articles' deployment picture: a load balancer in front of inference instances, each
doing its own dynamic batching; for a model that fits one device, scaling out by instances
(data parallelism) rather than by tensor or pipeline parallelism. Here every replica is an
:class:`~llmlab.serve.async_engine.AsyncEngine` with its own weights and KV cache; the router
counts each replica's requests in flight (admitted, not finished) and picks the smallest count,
ties going round-robin from the replica after the last one picked (vLLM's data-parallel load
balancer routes on queue lengths the same way).
"""

from __future__ import annotations


def least_loaded(loads: list[int], start: int = 0) -> int:
    """Index of the smallest load; among equal loads the first at or after ``start`` (cyclic).

    ``loads``: requests in flight per replica. Raises ``ValueError`` for an empty list."""
    if not loads:
        raise ValueError("no replicas to route to")
    n = len(loads)
    order = [(start + k) % n for k in range(n)]
    return min(order, key=lambda i: loads[i])


class Router:
    """Route each request to one of ``engines`` (the replicas, AsyncEngine) by a ``policy``.

    ``policy(loads, start) -> index``: ``loads`` the requests in flight per live replica, ``start``
    the index after the last one picked; default :func:`least_loaded` (lab 11 hands
    ``start_server(routing_policy=...)`` the learner's). :meth:`pick` raises ``ValueError`` when the policy
    returns something other than an index into ``loads``; the constructor, for no engines."""

    def __init__(self, engines: list, policy=None):
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engines)
        self.policy = policy if policy is not None else least_loaded
        self._next = 0

    def pick(self):
        alive = [e for e in self.engines if e.is_running] or self.engines
        i = self.policy([e.num_in_flight for e in alive], self._next % len(alive))
        if not isinstance(i, int) or not 0 <= i < len(alive):
            raise ValueError(
                f"routing policy {getattr(self.policy, '__name__', self.policy)!r} "
                f"returned {i!r}: expected an index in [0, {len(alive)})"
            )
        self._next = i + 1
        return alive[i]

    def loads(self) -> list[int]:
        return [e.num_in_flight for e in self.engines]
