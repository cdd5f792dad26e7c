"""Lab 04 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations

import torch


def topk_route(logits: torch.Tensor, k: int, capacity: int | None):
    """Lab 04. Top-k routing with capacity (Switch/GShard; Fedus et al. 2021 §2.1).

    ``logits [T, E]``. Softmax over experts; each token picks its ``k`` most probable experts and
    weights renormalised to sum to 1 over the chosen ``k``. With ``capacity``, each expert keeps at
    most ``capacity`` assignments, in token order (earlier tokens first, over all k choices of a
    token before the next token); the rest are dropped. Return ``(experts [T, k] int64, weights
    [T, k], kept [T, k] bool)``.
    """
    probs = logits.float().softmax(-1)
    w, e = probs.topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    kept = torch.ones_like(e, dtype=torch.bool)
    if capacity is not None:
        counts = torch.zeros(logits.shape[-1], dtype=torch.long)
        for t in range(e.shape[0]):
            for j in range(k):
                x = int(e[t, j])
                kept[t, j] = bool(counts[x] < capacity)
                counts[x] += 1
    return e, w, kept


EXERCISES = [topk_route]
