"""Lab 04 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations

import torch
import torch.distributed as dist


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


def load_balancing_loss(
    router_probs: torch.Tensor, expert_index: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Lab 04. Switch Transformer's auxiliary load-balancing loss, without its coefficient α
    (Fedus et al. 2021, §2.2, eq. 4-6).

    ``router_probs [T, E]``: the router's softmax over the ``E = num_experts`` experts for each of
    ``T`` tokens; ``expert_index [T, k]`` int64: the experts each token was sent to (top-k). With
    ``f_i`` the fraction of the ``T·k`` assignments that went to expert ``i`` and ``P_i`` the mean
    router probability of expert ``i`` over the tokens, return the scalar ``E · Σ_i f_i · P_i``
    (1.0 when routing is perfectly uniform; it grows as tokens pile onto the experts the router
    favours).
    """
    T, k = expert_index.shape
    f = torch.bincount(expert_index.reshape(-1), minlength=num_experts).float() / (T * k)
    P = router_probs.float().mean(0)
    return num_experts * (f * P).sum()


def a2a_split_sizes(tokens_per_expert: torch.Tensor, group=None) -> tuple[list[int], list[int]]:
    """Lab 04. The split sizes of expert parallelism's dispatch all-to-all, on real ranks.

    ``tokens_per_expert [E]`` int64: how many of this rank's token rows go to each expert. The
    ``ep`` ranks of ``group`` hold ``E/ep`` consecutive experts each (rank ``j``: experts
    ``j·E/ep .. (j+1)·E/ep - 1``). Return ``(input_splits, output_splits)``, two lists of ``ep``
    ints: rows this rank sends to each rank, and rows it will receive from each rank, which only
    the other ranks know: exchange the counts with ``dist.all_to_all_single`` first (GShard,
    Lepikhin et al. 2020, §3.2; Megatron-LM's token dispatcher does the same).
    """
    ep = dist.get_world_size(group)
    send = tokens_per_expert.reshape(ep, -1)
    recv = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(recv, tokens_per_expert.contiguous(), group=group)
    return send.sum(1).tolist(), recv.reshape(ep, -1).sum(1).tolist()


EXERCISES = [topk_route, load_balancing_loss, a2a_split_sizes]
