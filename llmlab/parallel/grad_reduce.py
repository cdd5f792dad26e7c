"""The one rule for summing 16-bit gradients over ranks without overflowing.

Every gradient collective in ``llmlab.parallel`` is one of two kinds, and each kind has one rule:

**An average over replicas** (data parallelism over ``dp``/``edp``/``dp x cp``: naive DP, DDP,
ring, ZeRO 1/2/3, EP's ``sync_moe_grads``). Each rank divides its gradient by the group size
``N`` *before* the sum (:func:`predivide_`), so the collective's sum is already the mean. Then
``|sum_i g_i / N| <= max_i |g_i|``, and so is every partial sum a ring or tree adds up on the way:
the reduction cannot overflow where no rank's gradient does. Summing first and dividing after
overflows fp16 (largest finite value 65504) as soon as the *sum* passes it: at ``N = 8`` a
gradient of 8188 on every rank, with the loss scale applied, is enough, although the mean is
finite (:func:`mean_over_ranks` shows both, in numbers, for the lab). This is what PyTorch DDP's
default communication hook does (divide, then all-reduce); DeepSpeed's
``gradient_predivide_factor`` and FSDP's pre/post-divide factors split the same division around
the sum; Megatron instead reduces in fp32 (``grad_reduce_in_fp32``). In fp32 and for ``N`` a power
of two the division is exact, so pre-dividing gives bit-identical averages.

**A sum of partial gradients** (tensor/sequence parallelism: the gradient of a norm weight or a
row-parallel bias from each rank's tokens, replicated kv heads, the input gradient of a
column-parallel layer). The sum *is* the gradient; dividing would change it. In fp16 these are
summed in fp32 and cast back (:func:`all_reduce_sum_`, :func:`reduce_scatter_sum`), so the result
overflows only where the true gradient does (where one device overflows too). bf16 has fp32's
exponent range, so bf16 and fp32 are summed in their own dtype (:func:`sum_dtype`).

Pipeline parallelism sums no gradient over ranks (tied embeddings across stages are refused) and
ring attention accumulates its key/value gradients in fp32 already.
"""

from __future__ import annotations

import torch

from llmlab.runtime import comm
from llmlab.runtime.comm import Group

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504


def predivide_(t: torch.Tensor, n: int) -> torch.Tensor:
    """Divide ``t`` (any shape) by the group size ``n`` in place before it is summed over the group
    (an average over replicas); returns ``t``. Nothing happens for ``n == 1``."""
    if n > 1:
        t.div_(n)
    return t


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of partial gradients of ``dtype`` runs in: fp32 for fp16, else ``dtype``."""
    return torch.float32 if dtype == torch.float16 else dtype


def all_reduce_sum_(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum the partial gradients ``t`` over ``group`` in place (fp16: in fp32, cast back)."""
    wide = sum_dtype(t.dtype)
    if wide == t.dtype:
        comm.all_reduce(t, group=group)
        return t
    staging = t.to(wide)
    comm.all_reduce(staging, group=group)
    t.copy_(staging)
    return t


def reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, group: Group) -> torch.Tensor:
    """Reduce-scatter the partial gradients ``inp`` (1-D or with dim 0 split) into ``out``
    (fp16: in fp32, cast back); returns ``out``."""
    wide = sum_dtype(inp.dtype)
    if wide == inp.dtype:
        comm.reduce_scatter_tensor(out, inp, group=group)
        return out
    staging = torch.empty(out.shape, dtype=wide, device=out.device)
    comm.reduce_scatter_tensor(staging, inp.to(wide), group=group)
    out.copy_(staging)
    return out


def mean_over_ranks(grads: torch.Tensor, group: Group, predivide: bool = True) -> torch.Tensor:
    """The mean of this rank's ``grads`` over ``group`` by one real all-reduce, in ``grads``'
    dtype: divided before the sum (``predivide=True``, llmlab's rule) or after it (what ZeRO did
    before: the fp16 sum can overflow). Returns a new tensor; collective over ``group``."""
    n = comm.group_size(group)
    t = grads.detach().clone()
    if predivide:
        predivide_(t, n)
    if n > 1:
        comm.all_reduce(t, group=group)
    if not predivide:
        t.div_(n)
    return t
