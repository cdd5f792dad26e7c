"""Lab 05 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations



def shard_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """Lab 05. ZeRO partitioning: the ``[start, end)`` elements of a flat buffer of ``numel`` that
    ``rank`` owns when it is padded to a multiple of ``world`` and cut into equal shards
    (Rajbhandari et al. 2020, §5). The last shards may be shorter (or empty) once clipped to
    ``numel``."""
    per = -(-numel // world)
    start = min(rank * per, numel)
    return start, min(start + per, numel)


EXERCISES = [shard_range]
