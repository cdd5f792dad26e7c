"""Lab 09 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations

import torch


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,
                          scores: torch.Tensor, v: torch.Tensor):
    """Lab 09. One tile of FlashAttention's online softmax (Dao et al. 2022, Alg. 1).

    State per query row: running max ``m [Q]``, running sum of exponentials ``l [Q]``, unnormalised
    output ``acc [Q, D]``. A new tile of ``scores [Q, K]`` with values ``v [K, D]`` arrives: return
    the updated ``(m, l, acc)``; ``acc / l[:, None]`` is then softmax(all scores so far) @ V.
    """
    m_new = torch.maximum(m, scores.amax(-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + p @ v


EXERCISES = [online_softmax_update]
