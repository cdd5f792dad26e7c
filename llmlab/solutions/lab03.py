"""Lab 03 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """Lab 03. The 1F1B action list of one pipeline stage (PipeDream-Flush; Narayanan et al. 2021
    §2.2): ``min(num_stages - stage - 1, m)`` warm-up forwards, then alternate one forward and one
    backward, then the remaining backwards. Actions are ``("F", mb)`` / ``("B", mb)``."""
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    acts = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        acts.append(("F", f))
        f += 1
        acts.append(("B", b))
        b += 1
    acts += [("B", i) for i in range(b, m)]
    return acts


def bubble_fraction(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Lab 03. The pipeline bubble: the idle share of one flush (a fraction in [0, 1)).

    GPipe and 1F1B with ``p = num_stages`` stages and ``m = num_microbatches`` micro-batches idle
    ``(p-1)/(m+p-1)`` of the time (GPipe, Huang et al. 2019, §2.2; PipeDream-Flush idles as much);
    the interleaved schedule with ``v = virtual_stages`` model chunks per rank cuts the bubble by v:
    ``(p-1)/(v·m+p-1)`` (Narayanan et al. 2021, §2.2.2; both written relative to the total time).
    """
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)


def pipeline_forward(microbatches: list[torch.Tensor], stage_fn, rank: int, world: int):
    """Lab 03. The forward phase of a GPipe pipeline on real ranks, with ``dist.send``/``dist.recv``.

    Rank ``r`` is stage ``r`` of ``world``; ``stage_fn`` is this rank's layers (activations keep
    their shape ``[b, h]``). For each micro-batch in order: stage 0 takes ``microbatches[i]``,
    the other stages receive the activation from rank ``r-1``; every stage applies ``stage_fn``;
    every stage but the last sends the result to rank ``r+1``. The last stage returns the list of
    its outputs in micro-batch order; the other stages return ``None``. Only rank 0 reads the
    micro-batches' values; the others use their shapes to size the receive buffers (GPipe, Huang
    et al. 2019, §2.2).
    """
    outs = []
    for mb in microbatches:
        x = mb if rank == 0 else torch.empty_like(mb)
        if rank > 0:
            dist.recv(x, rank - 1)
        y = stage_fn(x)
        if rank < world - 1:
            dist.send(y.contiguous(), rank + 1)
        else:
            outs.append(y)
    return outs if rank == world - 1 else None


EXERCISES = [one_f_one_b, bubble_fraction, pipeline_forward]
