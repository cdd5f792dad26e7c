"""Learner exercises: the stubs' contracts and their reference solutions.

Each lab has exercise cells: the learner writes a function, then a :mod:`llmlab.check` helper runs
it (on real ranks where communication is the point) against the reference below on the same seed
and data, and says in plain words what differs. The labs run with solutions switched on in CI.

Switching:

* ``LLMLAB_SOLUTIONS=1`` in the environment: every exercise uses its reference solution;
* ``llmlab.exercises.reveal("name")``: this one exercise uses the solution (to move on);
* otherwise :func:`pick` returns the learner's own function.

In a notebook::

    def ring_reduce_scatter(chunks, rank, world):
        ...  # your code
    ring_reduce_scatter = exercises.pick("ring_reduce_scatter", ring_reduce_scatter)
    check.ring_reduce_scatter(ring_reduce_scatter)
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

_revealed: set[str] = set()


def solutions_on() -> bool:
    return os.environ.get("LLMLAB_SOLUTIONS", "0") not in ("", "0", "false", "False")


def reveal(name: str) -> None:
    """Use the reference solution for exercise ``name`` from now on (raises ``KeyError`` if unknown)."""
    if name not in SOLUTIONS:
        raise KeyError(f"no exercise named {name!r}; exercises: {', '.join(sorted(SOLUTIONS))}")
    _revealed.add(name)


def pick(name: str, learner_fn):
    """The function to check/use: the solution if switched on, else the learner's."""
    if name not in SOLUTIONS:
        raise KeyError(f"no exercise named {name!r}; exercises: {', '.join(sorted(SOLUTIONS))}")
    return SOLUTIONS[name] if (solutions_on() or name in _revealed) else learner_fn


# --------------------------------------------------------------------------------------------
# Reference solutions (one per lab). Each docstring is the exercise statement.
# --------------------------------------------------------------------------------------------
def training_memory_bytes(num_params: int, bytes_per_param: int = 4, optimizer_states: int = 2) -> dict:
    """Lab 00. Bytes of parameters, gradients and optimizer states for plain fp32 Adam training:
    return ``{"params", "grads", "optimizer_states"}`` (Adam keeps ``optimizer_states`` = 2 fp32
    tensors per parameter: m and v)."""
    return {"params": num_params * bytes_per_param, "grads": num_params * bytes_per_param,
            "optimizer_states": num_params * bytes_per_param * optimizer_states}


def ring_reduce_scatter(chunks: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
    """Lab 01. The reduce-scatter phase of ring all-reduce, with ``dist.send``/``dist.recv`` only.

    ``chunks``: this rank's tensor split into ``world`` equal chunks. In step ``s`` (0..world-2)
    rank ``r`` sends its running chunk ``(r - s) % world`` to rank ``r+1`` and adds what it receives
    from rank ``r-1`` into its chunk ``(r - s - 1) % world``. Return the fully reduced chunk
    ``(rank + 1) % world`` (the sum of that chunk over all ranks). Each rank sends
    (world-1)/world of the tensor.
    """
    chunks = [c.clone() for c in chunks]
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        send_idx, recv_idx = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(chunks[recv_idx])
        if rank % 2 == 0:  # even ranks send first, odd ranks receive first: no deadlock
            dist.send(chunks[send_idx], right)
            dist.recv(buf, left)
        else:
            dist.recv(buf, left)
            dist.send(chunks[send_idx], right)
        chunks[recv_idx] += buf
    return chunks[(rank + 1) % world]


def row_parallel_forward(x_shard: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None,
                         group=None) -> torch.Tensor:
    """Lab 02. ``RowParallelLinear.forward`` (Megatron-LM, Shoeybi et al. 2019, §3).

    ``x_shard [B, in/tp]`` is this rank's slice of the input features, ``w_shard [out, in/tp]`` the
    matching columns of the weight; return the full ``y = x @ W.T + bias`` ``[B, out]`` on every
    rank: a partial product, an all-reduce (sum) over ``group``, and the bias added once.
    """
    y = x_shard @ w_shard.t()
    dist.all_reduce(y, group=group)
    return y if bias is None else y + bias


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


def shard_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """Lab 05. ZeRO partitioning: the ``[start, end)`` elements of a flat buffer of ``numel`` that
    ``rank`` owns when it is padded to a multiple of ``world`` and cut into equal shards
    (Rajbhandari et al. 2020, §5). The last shards may be shorter (or empty) once clipped to
    ``numel``."""
    per = -(-numel // world)
    start = min(rank * per, numel)
    return start, min(start + per, numel)


def append_slot(block_table: list[int], num_tokens: int, block_size: int,
                ref_counts: dict[int, int], free_blocks: list[int]) -> tuple[list[int], int | None]:
    """Lab 06. Where does token number ``num_tokens`` (0-based) of a sequence go?

    If it starts a new block, take ``free_blocks.pop(0)`` and append it to the table. If it lands in
    the last block and that block is shared (ref count > 1), copy-on-write: take a fresh block,
    decrement the shared block's ref count, replace it in the table, and return the shared block's
    id as the one to copy from. Returns ``(block_table, copy_from)`` with ``copy_from`` None when
    nothing must be copied; ref counts of new blocks are 1.
    """
    table = list(block_table)
    if num_tokens % block_size == 0:
        b = free_blocks.pop(0)
        ref_counts[b] = 1
        table.append(b)
        return table, None
    last = table[-1]
    if ref_counts[last] > 1:
        b = free_blocks.pop(0)
        ref_counts[b] = 1
        ref_counts[last] -= 1
        table[-1] = b
        return table, last
    return table, None


def schedule_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]],
                  max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[str, int]]:
    """Lab 07. One continuous-batching step (Orca, Yu et al. 2022; vLLM v1 style).

    ``running``/``waiting``: ``(request_id, tokens_still_to_compute)`` in FCFS order. First every
    running request gets its tokens (decode: usually 1) while the token budget lasts, then waiting
    requests are admitted in order while fewer than ``max_num_seqs`` are scheduled, each getting
    ``min(remaining, budget left)`` tokens (chunked prefill). Return ``[(request_id, tokens)]``.
    """
    out, budget = [], max_num_batched_tokens
    for rid, n in running + waiting:
        if budget <= 0 or len(out) >= max_num_seqs:
            break
        take = min(n, budget)
        out.append((rid, take))
        budget -= take
    return out


def rank_coords(rank: int, dp: int, tp: int, pp: int) -> dict:
    """Lab 08. Megatron's rank order (tp fastest, then dp, then pp): return ``{"dp", "tp", "pp"}``
    indices of ``rank``."""
    return {"pp": rank // (dp * tp), "dp": (rank // tp) % dp, "tp": rank % tp}


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


SOLUTIONS = {f.__name__: f for f in (
    training_memory_bytes, ring_reduce_scatter, row_parallel_forward, one_f_one_b, topk_route,
    shard_range, append_slot, schedule_step, rank_coords, online_softmax_update)}

LAB_OF = {"training_memory_bytes": "00", "ring_reduce_scatter": "01", "row_parallel_forward": "02",
          "one_f_one_b": "03", "topk_route": "04", "shard_range": "05", "append_slot": "06",
          "schedule_step": "07", "rank_coords": "08", "online_softmax_update": "09"}
