"""Mixture-of-experts MLP: softmax router, top-k routing, capacity, load-balancing and z-loss.

A :class:`MoE` layer replaces the dense SwiGLU MLP of a decoder layer (Shazeer et al. 2017;
GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021). For each token ``t``:

1. router: ``probs[t] = softmax(gate(x_t))`` over ``E`` experts (logits in fp32);
2. top-k: the ``K`` largest probabilities; their weights are renormalised to sum to 1
   (``w = p / sum(top-k p)``, as in Mixtral and GShard top-2). With ``K = 1`` the weight is then
   exactly 1 and the router learns only from the auxiliary losses; set
   ``config.extra["norm_topk_prob"] = False`` for Switch's top-1 (``w = p``, §2.1);
3. capacity (optional): each expert takes at most
   ``C = ceil(capacity_factor * N * K / E)`` of the ``N`` tokens this layer sees in one forward
   (Megatron's ``get_capacity`` convention: tokens x top-k / experts x factor). Assignments are
   served first choices first, then second choices, each in token order (GShard Algorithm 2);
   an assignment over capacity is *dropped*: the token skips that expert (its residual passes
   through). ``capacity_factor=None`` is dropless;
4. ``y_t = sum_k w_tk * expert_k(x_t)`` over the kept assignments.

Auxiliary loss stored in ``self.aux_loss`` after each forward (``LlamaForCausalLM`` adds it to the
cross-entropy)::

    aux = router_aux_loss_coef * lb + router_z_loss_coef * z
    lb  = mean over sequences s of  E * sum_i f_si * P_si          (Switch eq. 4, GShard groups)
    z   = mean over tokens of logsumexp(logits_t) ** 2            (ST-MoE, Zoph et al. 2022, §3.1)

``f_si`` is the fraction of sequence ``s``'s ``T*K`` routing assignments that chose expert ``i``
(counted before dropping) and ``P_si`` the mean router probability of expert ``i`` over its
tokens; perfectly balanced routing gives ``lb = 1``.

Why per sequence (GShard computes the balancing loss per *group* of tokens; here a group is one
sequence): Switch's ``f·P`` is not linear in the tokens, so a batch-level loss depends on how the
batch is cut into data-parallel slices and micro-batches, and a data-parallel run would differ
from the one-rank run unless ``f`` were all-reduced for every micro-batch (and even then only for
the same micro-batch split). A mean over sequences is linear, like the cross-entropy: every
layout (dp, ep, pp, number of micro-batches) gives exactly the one-rank loss and gradient, with
no extra communication. The z-loss is a token mean, so it has the same property.

Per-expert statistics of the last forward (this rank's tokens): ``tokens_per_expert`` (int64
``[E]``, assignments routed to each expert before dropping), ``dropped_per_expert`` (``[E]``),
``dropped_tokens`` (int), ``capacity`` (int or None), ``lb_loss`` and ``z_loss`` (floats).
They are also summed over forwards until :func:`collect_moe_stats` reads them.

Expert parallelism (:mod:`llmlab.parallel.expert_parallel`) keeps only some experts on a rank and
replaces :meth:`MoE.run_experts` with a dispatch/combine over all-to-all; everything else (router,
top-k, capacity, losses) is the same code, applied to the rank's own tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmlab.model.config import ModelConfig
from llmlab.model.layers import MLP


class MoE(nn.Module):
    """Mixture-of-experts SwiGLU MLP. ``forward(x [B,T,h] or [N,h]) -> same shape``.

    Parameters (HF Mixtral-like names): ``gate`` (``Linear(h, E, bias=False)``, the router) and
    ``experts.{i}.{gate,up,down}_proj`` (``E`` SwiGLU MLPs of width ``moe_intermediate_size``).

    Raises ``ValueError`` if ``num_experts < 1`` or top-k is not in ``1..E`` (config validation).
    """

    # summed over forwards since the last reset_stats (read by collect_moe_stats)
    _acc_tokens: torch.Tensor
    _acc_dropped: torch.Tensor
    _acc_lb: float
    _acc_calls: int
    _acc_near_ties: int

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.num_experts < 1:
            raise ValueError(f"num_experts={config.num_experts} must be >= 1 for a MoE layer")
        config.validate()
        h = config.hidden_size
        ffn = config.moe_intermediate_size or config.intermediate_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.capacity_factor = config.capacity_factor
        self.aux_coef = config.router_aux_loss_coef
        self.z_coef = config.router_z_loss_coef
        self.norm_topk_prob = bool(config.extra.get("norm_topk_prob", True))
        self.gate = nn.Linear(h, self.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(h, ffn, config.mlp_bias) for _ in range(self.num_experts))
        self.aux_loss: torch.Tensor | None = None
        self.reset_stats()

    # --- routing -----------------------------------------------------------------------------
    def route(self, tokens: torch.Tensor):
        """Router for ``tokens [N,h]``: returns ``(logits [N,E] fp32, probs [N,E], topi [N,K],
        weights [N,K])`` where ``weights`` sum to 1 per token (unless ``norm_topk_prob`` is off)."""
        logits = self.gate(tokens).float()
        probs = logits.softmax(dim=-1)
        topv, topi = probs.topk(self.top_k, dim=-1)
        weights = topv / topv.sum(dim=-1, keepdim=True) if self.norm_topk_prob else topv
        return logits, probs, topi, weights

    def expert_capacity(self, num_tokens: int) -> int | None:
        """``ceil(capacity_factor * N * K / E)`` slots per expert, or None when dropless."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def keep_mask(self, topi: torch.Tensor, capacity: int | None) -> torch.Tensor:
        """Bool ``[K*N]`` over assignments in priority order (all first choices in token order,
        then all second choices ...): True where the assignment fits in its expert's capacity."""
        flat = topi.t().reshape(-1)
        if capacity is None:
            return torch.ones_like(flat, dtype=torch.bool)
        onehot = F.one_hot(flat, self.num_experts)
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place in the expert's queue
        return position < capacity

    # --- experts -----------------------------------------------------------------------------
    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Apply expert ``e`` to its rows: ``x [n,h]`` sorted by expert, ``counts [E]`` rows each.

        Every expert runs, even on zero rows, so each one takes part in autograd and gets a
        (zero) gradient rather than None: data-parallel gradient sync sees the same parameters
        on every rank.
        """
        chunks = x.split(counts.tolist())
        return torch.cat([self.experts[e](c) for e, c in enumerate(chunks)])

    # --- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = shape[-1]
        seq_len = shape[-2] if x.dim() >= 3 else shape[0]
        tokens = x.reshape(-1, h)
        N, E, K = tokens.shape[0], self.num_experts, self.top_k
        logits, probs, topi, weights = self.route(tokens)

        capacity = self.expert_capacity(N)
        keep = self.keep_mask(topi, capacity)  # [K*N], priority order
        expert_of = topi.t().reshape(-1)  # [K*N]
        token_of = torch.arange(N, device=x.device).repeat(K)  # [K*N]
        weight_of = weights.t().reshape(-1)  # [K*N]

        # Group the kept assignments by expert (stable: token order within an expert).
        e_kept = expert_of[keep]
        order = torch.argsort(e_kept, stable=True)
        e_sorted, t_sorted, w_sorted = e_kept[order], token_of[keep][order], weight_of[keep][order]
        counts = torch.bincount(e_sorted, minlength=E)
        y = self.run_experts(tokens[t_sorted], counts)  # [n_kept, h]
        out = torch.zeros_like(tokens).index_add(0, t_sorted, y * w_sorted[:, None].to(y.dtype))

        self._losses(logits, probs, topi, seq_len)
        self._record(expert_of, keep, capacity, probs)
        return out.reshape(shape)

    def _losses(self, logits, probs, topi, seq_len: int) -> None:
        E, K = self.num_experts, self.top_k
        S = probs.shape[0] // seq_len  # sequences in this call
        assigned = F.one_hot(topi, E).sum(1).float()  # [N,E] choices per token
        f = assigned.view(S, seq_len, E).mean(1) / K  # [S,E], rows sum to 1
        P = probs.view(S, seq_len, E).mean(1)  # [S,E]
        lb = (E * (f * P).sum(-1)).mean()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        self.lb_loss, self.z_loss = float(lb.detach()), float(z.detach())
        self.aux_loss = self.aux_coef * lb + self.z_coef * z

    @torch.no_grad()
    def _record(self, expert_of, keep, capacity, probs) -> None:
        E, K = self.num_experts, self.top_k
        if K < E:  # tokens whose k-th and (k+1)-th router probabilities nearly tie
            top = probs.float().topk(K + 1, dim=-1).values
            self._acc_near_ties += int((top[:, K - 1] - top[:, K] < NEAR_TIE).sum())
        self.tokens_per_expert = torch.bincount(expert_of, minlength=E).cpu()
        self.dropped_per_expert = torch.bincount(expert_of[~keep], minlength=E).cpu()
        self.dropped_tokens = int(self.dropped_per_expert.sum())
        self.capacity = capacity
        self._acc_tokens += self.tokens_per_expert
        self._acc_dropped += self.dropped_per_expert
        self._acc_lb += self.lb_loss
        self._acc_calls += 1

    def reset_stats(self) -> None:
        """Zero the statistics accumulated over forwards (read by :func:`collect_moe_stats`)."""
        E = self.num_experts
        self.tokens_per_expert = torch.zeros(E, dtype=torch.long)
        self.dropped_per_expert = torch.zeros(E, dtype=torch.long)
        self.dropped_tokens, self.capacity, self.lb_loss, self.z_loss = 0, None, 0.0, 0.0
        self._acc_tokens = torch.zeros(E, dtype=torch.long)
        self._acc_dropped = torch.zeros(E, dtype=torch.long)
        self._acc_lb, self._acc_calls = 0.0, 0
        self._acc_near_ties = 0


#: Router probabilities closer than this are a near tie: fp32 GEMMs of other shapes (another
#: rank count, a GPU) round differently by ~1e-6, enough to flip such a top-k choice.
NEAR_TIE = 1e-4


def moe_layers(model: nn.Module) -> list[MoE]:
    """The :class:`MoE` modules of ``model``, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def imbalance(counts) -> float:
    """Load imbalance of a routing: ``max_i count_i / mean_i count_i`` (1.0 = perfectly even)."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    return float(c.max() / c.mean()) if c.sum() > 0 else 1.0


def collect_moe_stats(model: nn.Module, group=None, pp_group=None, num_layers: int | None = None) -> dict:
    """Routing statistics accumulated since the last call, summed over ``group`` (the
    data-parallel group: every rank counts the tokens of its own slice) and, under pipeline
    parallelism, gathered over ``pp_group`` (each stage holds different layers), then reset.

    Returns ``{"tokens_per_expert": [[int]*E]*L, "dropped_tokens": int, "near_tie_tokens": int
    (token-layers whose k-th and (k+1)-th router probabilities differ by < :data:`NEAR_TIE`: the
    decisions another GEMM order, e.g. a GPU with other batch shapes, may flip), "lb_loss": float,
    "imbalance": float, "imbalance_max": float}`` over all ``L = num_layers`` MoE layers of the
    model (default: the layers this rank holds): imbalance = max/mean tokens per expert,
    averaged over layers (``imbalance_max``: the worst layer, which sets an EP step's time);
    ``lb_loss`` is the balancing loss averaged over layers. ``{}`` for a model without MoE layers.
    Collective over ``group`` and ``pp_group``: call it on all their ranks. Bookkeeping: it uses
    ``torch.distributed`` directly, so it is not counted in the comm bytes.
    """
    import torch.distributed as dist

    held: list[tuple[int, MoE]] = []  # (layer index, its MoE) in layer order
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoE):
            held.append((getattr(layer, "layer_idx", len(held)), mlp))
    if not held:
        return {}
    L, E = num_layers or len(held), held[0][1].num_experts
    index = (
        {idx: row for row, idx in enumerate(sorted(idx for idx, _ in held))}
        if num_layers is None
        else {idx: idx for idx, _ in held}
    )
    counts = torch.zeros(L, E, dtype=torch.float64)
    dropped = torch.zeros(1, dtype=torch.float64)
    near = torch.zeros(1, dtype=torch.float64)
    lb = torch.zeros(1, dtype=torch.float64)
    for idx, m in held:
        counts[index[idx]] = m._acc_tokens.double()
        dropped += m._acc_dropped.double().sum()
        near += float(m._acc_near_ties)
        lb += m._acc_lb / max(1, m._acc_calls)
    packed = torch.cat([counts.flatten(), dropped, near, lb])
    dp = 1
    for g in (group, pp_group):
        if dist.is_initialized() and g is not None and dist.get_world_size(g) > 1:
            dev = "cuda" if dist.get_backend(g) == "nccl" else "cpu"
            t = packed.to(dev)
            dist.all_reduce(t, group=g)
            packed = t.cpu()
            if g is group:
                dp = dist.get_world_size(g)
    n = counts.numel()
    counts, dropped, near, lb = packed[:n].view(L, E), packed[n], packed[n + 1], packed[n + 2] / dp / L
    for _, m in held:
        m.reset_stats()
    per_layer = [imbalance(c) for c in counts]
    return {
        "tokens_per_expert": counts.long().tolist(),
        "dropped_tokens": int(dropped),
        "near_tie_tokens": int(near),
        "lb_loss": float(lb),
        "imbalance": sum(per_layer) / len(per_layer),
        "imbalance_max": max(per_layer),
    }
