"""A layout (how the GPUs split the model and the batch) and the space the search walks.

A :class:`Layout` is ``dp × tp × pp × cp`` GPUs (``ep`` divides ``dp``: experts spread over the
data-parallel ranks), ZeRO stage, micro-batches per step, virtual stages per pipeline rank
(interleaved 1F1B when > 1) and activation recomputation (``"none"`` or ``"full"``: every layer
recomputed in backward; Korthikanti's "selective" recomputation of the attention scores is what
a fused attention kernel already does, so it is not a separate choice). Sequence parallelism is
on whenever ``tp > 1`` (Megatron-LM's practice; same bytes on the wire, activations / tp).

Ranks are ordered tp fastest, then cp, dp, pp (Megatron-LM's tp-cp-ep-dp-pp), so a tensor-parallel
group spans ``tp`` consecutive GPUs, a data-parallel group ``tp·cp·dp`` and a pipeline group all.
:func:`layouts` yields every valid layout of a model on ``n`` GPUs; :func:`why_invalid` says which
constraint a given one breaks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

RECOMPUTE = ("none", "full")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    num_microbatches: int = 1
    virtual_stages: int = 1
    recompute: str = "none"

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    @property
    def schedule(self) -> str:
        return "interleaved" if self.virtual_stages > 1 else "1f1b"

    def name(self) -> str:
        parts = [
            f"{k.upper()}{v}"
            for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))
            if v > 1
        ]
        out = "×".join(parts) or "1 GPU"
        if self.virtual_stages > 1:
            out += f" v{self.virtual_stages}"
        return out

    def to_dict(self) -> dict:
        return asdict(self) | {"sequence_parallel": self.sequence_parallel, "name": self.name()}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def why_invalid(lay: Layout, model, workload, gpus_per_node: int) -> str | None:
    """The first constraint ``lay`` breaks for this model and workload, or ``None``."""
    B = workload.global_batch_size
    checks = (
        (model.heads % lay.tp, f"tp={lay.tp} must divide the {model.heads} attention heads"),
        (
            lay.tp > gpus_per_node,
            f"tp={lay.tp} must fit in one node of {gpus_per_node} GPUs "
            f"(its collectives are on the critical path)",
        ),
        (
            model.num_layers % (lay.pp * lay.virtual_stages),
            f"pp*virtual_stages={lay.pp * lay.virtual_stages} must divide the {model.num_layers} layers",
        ),
        (
            workload.seq_len % (lay.cp * lay.tp),
            f"cp*tp={lay.cp * lay.tp} must divide seq_len={workload.seq_len} (sequence shards)",
        ),
        (B % lay.dp, f"dp={lay.dp} must divide the global batch of {B} sequences"),
        (
            B % lay.dp == 0 and (B // lay.dp) % lay.num_microbatches,
            f"num_microbatches={lay.num_microbatches} must divide the {B // max(1, lay.dp)} "
            f"sequences per data-parallel rank",
        ),
        (
            lay.virtual_stages > 1 and (lay.pp == 1 or lay.num_microbatches % lay.pp),
            "virtual stages need pp > 1 and num_microbatches a multiple of pp",
        ),
        (
            lay.pp > 1 and lay.num_microbatches < lay.pp,
            f"num_microbatches={lay.num_microbatches} must be >= pp={lay.pp} (else stages idle)",
        ),
        (
            bool(model.num_experts) and (model.num_experts % lay.ep or lay.dp % lay.ep),
            f"ep={lay.ep} must divide num_experts={model.num_experts} and dp={lay.dp}",
        ),
        (not model.num_experts and lay.ep > 1, "ep > 1 needs a mixture-of-experts model"),
        (lay.zero and lay.dp * lay.cp == 1, "ZeRO needs data-parallel ranks to shard over"),
        (lay.recompute not in RECOMPUTE, f"recompute must be one of {RECOMPUTE}"),
    )
    return next((msg for bad, msg in checks if bad), None)


def _microbatch_counts(per_rank: int, pp: int, max_count: int) -> list[int]:
    """Powers of two dividing ``per_rank`` (and ``per_rank`` itself), >= pp, up to max_count."""
    out = {m for m in (2**i for i in range(0, 20)) if m <= per_rank and per_rank % m == 0}
    out.add(per_rank)
    return sorted(m for m in out if pp <= m <= max_count or (pp == 1 and m == 1))


def layouts(
    model, workload, num_gpus: int, gpus_per_node: int, max_microbatches: int = 64, zero_stages=(0, 1, 2, 3)
):
    """Every valid layout using exactly ``num_gpus`` GPUs (a generator).

    Micro-batch counts are the powers of two dividing each data-parallel rank's share (up to
    ``max_microbatches``, and the whole share): more micro-batches than that only add per-call
    latency in this model. Virtual stages 1, 2, 4; ZeRO stages ``zero_stages``.
    """
    B = workload.global_batch_size
    eps = [e for e in _divisors(model.num_experts)] if model.num_experts else [1]
    for tp in _divisors(num_gpus):
        for pp in _divisors(num_gpus // tp):
            for cp in _divisors(num_gpus // (tp * pp)):
                dp = num_gpus // (tp * pp * cp)
                if B % dp:
                    continue
                for m in _microbatch_counts(B // dp, pp, max_microbatches):
                    for v in (1, 2, 4) if pp > 1 else (1,):
                        for ep in eps:
                            for zero in zero_stages:
                                for rc in RECOMPUTE:
                                    lay = Layout(dp, tp, pp, cp, ep, zero, m, v, rc)
                                    if why_invalid(lay, model, workload, gpus_per_node) is None:
                                        yield lay
