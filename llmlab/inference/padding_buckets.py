"""Optional CPU heuristic: cut a step's attention into a few calls when that saves padding.

Nothing here is about paging. The PyTorch reference attention
(:func:`~llmlab.inference.paged_attention.paged_attention_reference`) pads every sequence of a
call to the call's longest query and longest context, so one long context in a large decode batch
makes every row pay for it. The model runner may (``ModelRunner(padding_buckets=True)``, the
default where the reference runs) cut each of its prefill and decode groups into buckets of
similar length with :func:`buckets`; the Triton kernel pads nothing, so where it runs the whole
step is one call. Each row's result is the same maths either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmlab.inference.sequence import Sequence

CALL_COST = 32768  # one more attention call, in padded (query, key) pairs; rough CPU figure


def buckets(group: list[tuple[Sequence, int]], max_parts: int = 4) -> list[list[tuple[Sequence, int]]]:
    """Cut ``(seq, num_new_tokens)`` pairs, sorted by context length, into up to ``max_parts``
    contiguous buckets when that saves padding: a call costs about ``S * max_context *
    (max_query + 16)`` (the gathered keys count like 16 queries), plus :data:`CALL_COST` (both
    rough CPU figures, measured on the shipped model: large decode batches split, a few prompts
    do not). Greedy: split the bucket where one cut saves the most, while it saves more than a
    call costs."""
    g = sorted(group, key=lambda x: x[0].num_computed_tokens + x[1])
    ctx = [s.num_computed_tokens + n for s, n in g]  # ascending
    ql = [n for _, n in g]

    def cost(
        lo: int, hi: int, qmax: int
    ) -> int:  # bucket g[lo:hi]: keys gathered (each counted like 16 queries)
        return (hi - lo) * ctx[hi - 1] * (qmax + 16)  # plus (query, key) pairs

    def best_cut(
        lo: int, hi: int
    ) -> tuple[int, int | None]:  # (gain, cut) of the best single cut of g[lo:hi], O(hi - lo)
        pre: list[int] = []
        m = 0
        for i in range(lo, hi):
            m = max(m, ql[i])
            pre.append(m)  # max query of g[lo:i+1]
        suf, m = [0] * (hi - lo + 1), 0
        for i in range(hi - 1, lo - 1, -1):
            m = max(m, ql[i])
            suf[i - lo] = m  # max query of g[i:hi]
        whole = cost(lo, hi, pre[-1])
        best: tuple[int, int | None] = (0, None)
        for i in range(lo + 1, hi):
            gain = whole - cost(lo, i, pre[i - 1 - lo]) - cost(i, hi, suf[i - lo]) - CALL_COST
            if gain > best[0]:
                best = (gain, i)
        return best

    bounds = [(0, len(g))]
    while len(bounds) < max_parts:
        found = [(best_cut(lo, hi), k) for k, (lo, hi) in enumerate(bounds) if hi - lo > 1]
        cuts = [(gain, cut, k) for (gain, cut), k in found if cut is not None]
        if not cuts:
            break
        _, cut, k = max(cuts)
        lo, hi = bounds[k]
        bounds[k : k + 1] = [(lo, cut), (cut, hi)]
    return [g[lo:hi] for lo, hi in bounds]
