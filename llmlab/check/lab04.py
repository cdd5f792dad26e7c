"""Checks for the lab 04 exercises (:mod:`llmlab.solutions.lab04`)."""

from __future__ import annotations

import torch

import torch.distributed as dist

from llmlab.check._base import _fail, _ok, _close, _run_on_ranks
from llmlab.solutions import lab04 as ex


def topk_route(fn) -> bool:
    name = "topk_route"
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 4, generator=g)
    for k, cap in ((1, None), (2, None), (2, 4), (1, 2)):
        want, got = ex.topk_route(logits, k, cap), fn(logits, k, cap)
        for part, w, o in zip(("experts", "weights", "kept"), want, got):
            if not (torch.equal(w, o) if w.dtype in (torch.bool, torch.int64) else _close(o, w)):
                _fail(
                    name,
                    f"{part} for k={k}, capacity={cap}",
                    w,
                    o,
                    "weights are softmax probabilities renormalised over the chosen k; an expert "
                    "keeps assignments in token order until it has `capacity`.",
                )
    return _ok(name, "top-1/top-2 routing, renormalised weights and capacity drops match")


def load_balancing_loss(fn) -> bool:
    name = "load_balancing_loss"
    from llmlab.model.config import get_preset
    from llmlab.model.moe import MoE

    g = torch.Generator().manual_seed(0)
    cases = []
    for T, E, k, scale in ((16, 4, 1, 1.0), (16, 4, 2, 1.0), (12, 8, 2, 4.0)):
        probs = (torch.randn(T, E, generator=g) * scale).softmax(-1)
        cases.append((f"T={T} tokens, E={E} experts, top-{k}", probs, probs.topk(k, -1).indices, E))
    uniform = torch.full((8, 4), 0.25)
    cases.append(
        (
            "perfectly uniform routing (8 tokens, 4 experts, top-1)",
            uniform,
            torch.arange(8).remainder(4)[:, None],
            4,
        )
    )
    # the router of llmlab's MoE layer (tiny-moe, one sequence): its lb_loss is the same quantity
    torch.manual_seed(0)
    layer = MoE(get_preset("tiny-moe"))
    x = torch.randn(1, 24, layer.gate.in_features)
    with torch.no_grad():
        layer(x)
        _, probs, topi, _ = layer.route(x.reshape(-1, x.shape[-1]))
    cases.append(("llmlab's tiny-moe router on 24 tokens (top-2)", probs, topi, layer.num_experts))
    for what, probs, idx, E in cases:
        want, got = ex.load_balancing_loss(probs, idx, E), fn(probs, idx, E)
        got_t = (
            torch.as_tensor(got, dtype=torch.float32) if isinstance(got, (int, float, torch.Tensor)) else got
        )
        if not (
            isinstance(got_t, torch.Tensor)
            and got_t.numel() == 1
            and torch.allclose(got_t.reshape(()), want, atol=1e-5, rtol=1e-5)
        ):
            _fail(
                name,
                f"loss for {what}",
                float(want),
                got,
                "f_i counts assignments (all k choices of every token, divided by T·k), P_i averages "
                "the router probabilities over tokens, and the loss is E · Σ f_i · P_i (1.0 when uniform).",
            )
    return _ok(name, "the Switch balancing loss matches for 5 routings, llmlab's MoE router among them")


def _counts(rank: int, E: int) -> torch.Tensor:
    return torch.randint(0, 9, (E,), generator=torch.Generator().manual_seed(10 + rank))


def _split_job(fn, E):
    rank, ep = dist.get_rank(), dist.get_world_size()
    got = fn(_counts(rank, E), None)
    per = E // ep
    want_in = [int(_counts(rank, E)[j * per : (j + 1) * per].sum()) for j in range(ep)]
    want_out = [int(_counts(src, E)[rank * per : (rank + 1) * per].sum()) for src in range(ep)]
    return got, (want_in, want_out), [_counts(r, E).tolist() for r in range(ep)]


def a2a_split_sizes(fn, ep: int = 3, num_experts: int = 6) -> bool:
    name = "a2a_split_sizes"
    for r, (got, want, counts) in enumerate(_run_on_ranks(name, _split_job, ep, fn, num_experts)):
        got = (
            tuple([int(v) for v in x] for x in got)
            if isinstance(got, (tuple, list)) and len(got) == 2
            else got
        )
        for part, i, hint in (
            (
                "input_splits (rows sent to each rank)",
                0,
                f"rank j owns experts j·E/ep .. (j+1)·E/ep - 1 ({num_experts // ep} "
                f"consecutive experts each): sum your counts over each rank's experts.",
            ),
            (
                "output_splits (rows received from each rank)",
                1,
                "only the senders know these: all_to_all_single your per-expert counts, "
                "then sum what rank j sent you over your own experts.",
            ),
        ):
            if not isinstance(got, tuple) or got[i] != want[i]:
                _fail(
                    name,
                    f"rank {r} of ep={ep}, E={num_experts}: {part}; tokens_per_expert on each rank: {counts}",
                    want[i],
                    got if not isinstance(got, tuple) else got[i],
                    hint,
                )
    return _ok(name, f"on {ep} real ranks the dispatch split sizes match what every rank sends and receives")
