"""Context parallelism (CP): the sequence split over ``cp`` ranks, from the loader to the loss.

Activations grow with the sequence length, and data, tensor and pipeline parallelism do not cut
them along the sequence (tensor parallelism's sequence parallelism only outside attention). With
``--cp N`` each rank of a context-parallel group holds ``S/N`` tokens of every sequence of its
data-parallel batch, with a full copy of the weights (of its TP/PP shard). Everything token-wise
(embedding, norms, MLP, LM head, loss) runs on the local tokens unchanged; only attention needs
the other tokens, and one of two algorithms provides them:

* ``ring`` (default; :mod:`llmlab.parallel.ring_attention`): K/V blocks travel around the ring,
  partial softmaxes are merged with the log-sum-exp rule; rank ``i`` holds chunks ``i`` and
  ``2N-1-i`` of ``2N`` (Megatron-LM's causal load balance). Needs ``2N | S``.
* ``ulysses`` (:mod:`llmlab.parallel.ulysses`): all-to-all to head shards and back (Jacobs et al.
  2023); rank ``i`` holds chunk ``i``. Needs ``N`` to divide the query and key/value heads per
  tensor-parallel rank.

How it composes (Megatron core does the same): the mesh has a ``cp`` dimension between tensor and
data parallelism (:mod:`llmlab.runtime.mesh`); the loader gives each CP rank its tokens of the
*same* global batch (:func:`shard_microbatches`); each rank's RoPE positions are those of its
tokens (``model.position_ids``); gradients are averaged over data×context-parallel ranks (DDP and
ZeRO get :meth:`~llmlab.runtime.mesh.Mesh.data_parallel_view`), which is the gradient of the
global mean loss because every CP rank has the same number of tokens. ZeRO therefore shards
over ``dp·cp`` ranks.

Sources: Liu et al. 2023 (ring attention); Jacobs et al. 2023 (DeepSpeed-Ulysses); NVIDIA
Megatron-LM "context parallelism" (Megatron core ``context_parallel`` docs).
"""

from __future__ import annotations

from typing import Any

import functools
import math

import torch

from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM
from llmlab.parallel.configs import ContextParallelConfig
from llmlab.parallel.ring_attention import ring_attention, ring_token_indices
from llmlab.parallel.ulysses import check_heads, ulysses_attention, ulysses_token_indices
from llmlab.runtime.mesh import Mesh

MODES = ("ring", "ulysses")


def token_indices(seq_len: int, cp: int, cp_rank: int, mode: str = "ring") -> torch.Tensor:
    """Positions (int64 ``[seq_len/cp]``) of the tokens CP rank ``cp_rank`` holds, in its order.

    ``ring``: chunks ``cp_rank`` and ``2cp-1-cp_rank`` of ``2cp``; ``ulysses``: chunk ``cp_rank``
    of ``cp``. Raises ``ValueError`` naming the divisibility constraint, or an unknown mode.
    """
    check_mode(mode)
    if mode == "ring":
        return ring_token_indices(seq_len, cp_rank, cp)
    return ulysses_token_indices(seq_len, cp_rank, cp)


def shard_microbatches(micro: list[Any], mesh: Mesh, mode: str = "ring") -> list[Any]:
    """This CP rank's tokens of each ``(inputs [b,S], labels [b,S])``: ``[b, S/cp]`` each."""
    if mesh.cp == 1:
        return micro
    idx = token_indices(micro[0][0].shape[1], mesh.cp, mesh.coords["cp"], mode)
    return [(x[:, idx.to(x.device)], y[:, idx.to(y.device)]) for x, y in micro]


def apply_context_parallel(
    model: LlamaForCausalLM, mesh: Mesh, mode: str, seq_len: int, overlap: bool = True
) -> LlamaForCausalLM:
    """Make ``model`` (a :class:`~llmlab.model.llama.LlamaForCausalLM`, possibly tensor-parallel)
    run on this CP rank's tokens: RoPE positions of those tokens, and every layer's attention core
    replaced by ring or Ulysses attention over ``mesh.groups["cp"]``. In place; returns ``model``.

    ``seq_len`` is the full sequence length (it fixes the positions); ``overlap=False`` makes the
    ring wait for each transfer before computing. Raises ``ValueError`` for an unknown mode or a
    sequence length the mode cannot split.
    """
    check_mode(mode)
    if mesh.cp == 1:
        return model
    group, ranks = mesh.groups["cp"], mesh.ranks["cp"]
    model.position_ids = token_indices(seq_len, mesh.cp, mesh.coords["cp"], mode)
    scale = 1.0 / math.sqrt(model.config.head_dim)
    if mode == "ring":
        core = functools.partial(ring_attention, group=group, ranks=ranks, scale=scale, overlap=overlap)
    else:
        core = functools.partial(ulysses_attention, group=group)
    for layer in model.model.layers:
        layer.self_attn.core_attention = core  # type: ignore[union-attr]
    return model


# --------------------------------------------------------------------------------------------
# The strategy's contract (llmlab.parallel.protocols)
# --------------------------------------------------------------------------------------------
def check_mode(mode: str) -> None:
    """``ValueError`` naming ``--cp-mode`` for a mode other than ring or ulysses."""
    if mode not in MODES:
        raise ValueError(f"--cp-mode {mode!r}: expected one of {', '.join(MODES)}")


def validate(config: ContextParallelConfig, mesh: Mesh, mc: ModelConfig) -> None:
    """Checks run before any rank starts (``TrainConfig.validate`` calls this); ``ValueError``
    names the constraint, ``NotImplementedError`` a combination this version does not have."""
    cp, mode, tp = mesh.cp, config.mode, mesh.tp
    check_mode(mode)
    if cp == 1:
        return
    if mode == "ring" and config.seq_len % (2 * cp):
        raise ValueError(
            f"--cp {cp} (ring): --seq-len {config.seq_len} must be divisible by 2*cp = "
            f"{2 * cp} (each rank holds 2 chunks of the sequence, for causal load balance)"
        )
    if mode == "ulysses":
        if config.seq_len % cp:
            raise ValueError(f"--cp {cp} (ulysses): --seq-len {config.seq_len} must be divisible by cp")
        check_heads(mc.num_attention_heads, mc.num_key_value_heads, cp, tp)
    if config.sequence_parallel and (config.seq_len // cp) % tp:
        raise ValueError(
            f"--sequence-parallel with --cp {cp}: tp={tp} must divide the tokens "
            f"per CP rank, --seq-len/cp = {config.seq_len // cp}"
        )
    from llmlab import kernels

    impl = kernels.settings().attention if hasattr(kernels, "settings") else "sdpa"
    if impl not in ("sdpa",):
        raise ValueError(
            f"--cp {cp}: context parallelism runs its own attention ({mode}); the "
            f"attention kind {impl!r} (llmlab.kernels) is not supported with it — use "
            f"the default 'sdpa'"
        )
    if mc.num_experts or mesh.ep > 1:
        raise NotImplementedError(
            f"--cp {cp} with mixture-of-experts models / --ep is not "
            f"supported yet (the router's auxiliary loss would see only "
            f"this rank's tokens)"
        )


def apply(model: LlamaForCausalLM, mesh: Mesh, config: ContextParallelConfig) -> LlamaForCausalLM:
    """``model`` running on this CP rank's tokens (:func:`apply_context_parallel`); unchanged
    when ``mesh.cp`` is 1."""
    return apply_context_parallel(model, mesh, config.mode, config.seq_len)
