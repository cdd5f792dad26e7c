"""Activations: bytes a transformer layer keeps from forward for backward.

Two different things, kept apart:

* :func:`activation_bytes_per_layer` is Korthikanti et al.'s model of a GPT layer ("Reducing
  Activation Recomputation in Large Transformer Models", 2022, §4, eqs. 1-3, Table 2): 16-bit
  activations, 1-byte dropout masks, explicit ``s × s`` attention scores. It gives the scaling
  (linear in the batch, linear plus quadratic in the sequence) and the effect of tensor/sequence
  parallelism and recomputation; it is not an exact count for llmlab's model.
* :func:`llama_block_activation_bytes` is a count of the tensors llmlab's own Llama block saves
  (RMSNorm, SwiGLU, grouped-query attention through PyTorch's fused kernel, no dropout), derived
  by listing what each operation keeps for its backward. Tests compare it with the bytes measured
  by :class:`llmlab.metrics.memory.SavedActivations`; it holds only as long as the block saves
  exactly these tensors.
"""

from __future__ import annotations

from llmlab.formulas._checks import check_count


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> int:
    """Bytes of activations one transformer layer saves for backward (16-bit activations).

    ``s·b·h·(34 + 5·a·s/h)`` without parallelism; with tensor parallelism t:
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``; with tensor + sequence parallelism:
    ``s·b·h·(34 + 5·a·s/h)/t``. ``recompute="selective"`` drops the 5·a·s/h attention term
    (score/softmax recomputed); ``"full"`` keeps only the layer input, 2·s·b·h (/t with SP).

    Args:
        seq_len: s (tokens); micro_batch_size: b (sequences); hidden_size: h; num_heads: a;
        tp: t, tensor-parallel degree (must divide ``num_heads``).

    Raises:
        ValueError: a non-positive size, ``tp`` not dividing ``num_heads``, unknown recompute.

    Source: Korthikanti et al. 2022 (arXiv 2205.05198), §4.1-4.2, eqs. 1-3, Table 2 and §5.
    """
    for name, v in (
        ("seq_len", seq_len),
        ("micro_batch_size", micro_batch_size),
        ("hidden_size", hidden_size),
        ("num_heads", num_heads),
        ("tp", tp),
    ):
        check_count(name, v)
    if num_heads % tp:
        raise ValueError(f"tp={tp} must divide num_heads={num_heads}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    s, b, h, a, t = seq_len, micro_batch_size, hidden_size, num_heads, tp
    attn = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if recompute == "full":
        per = 2.0 / t if sequence_parallel else 2.0
    elif sequence_parallel:
        per = (34.0 + attn) / t
    else:
        per = 10.0 + 24.0 / t + attn / t
    return round(s * b * h * per)


def activation_bytes_per_rank(
    seq_len: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    cp: int = 1,
) -> int:
    """Activation bytes one layer saves per rank with context parallelism over ``cp`` ranks.

    Every activation of a layer belongs to one token, and each CP rank holds ``s/cp`` tokens, so
    the per-rank bytes are :func:`activation_bytes_per_layer`'s divided by ``cp`` (Megatron-LM's
    context-parallel docs: "the activation memory footprint is reduced by cp times"). The
    quadratic attention term divides too: ring attention scores ``s/cp`` queries against one
    block at a time, Ulysses all ``s`` keys for ``a/cp`` heads.

    Raises:
        ValueError: ``cp`` not a positive integer dividing ``seq_len``, or as
            :func:`activation_bytes_per_layer`.
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or seq_len % cp:
        raise ValueError(f"cp={cp!r} must be a positive integer dividing seq_len={seq_len}")
    full = activation_bytes_per_layer(
        seq_len, micro_batch_size, hidden_size, num_heads, tp, sequence_parallel, recompute
    )
    return round(full / cp)


def llama_block_activation_bytes(
    b: int, s: int, h: int, f: int, a: int, t: int = 1, sequence_parallel: bool = False, dtype_bytes: int = 4
) -> int:
    """Bytes llmlab's Llama block saves for backward on one tensor-parallel rank.

    Elements, for ``b`` sequences of ``s`` tokens, hidden ``h``, MLP width ``f``, ``a`` query
    heads, tp degree ``t``:

    * ``6·b·s·h + 2·b·s``: the two RMSNorms (each keeps its input, the normalised input and its
      output — the next matmul's input — plus 1/rms per token), replicated over tp; divided by
      ``t`` with sequence parallelism, which shards them along the sequence;
    * ``4·b·s·h/t``: q, k, v (after the kv heads are repeated) and the attention output, which is
      also o_proj's input (the fused kernel writes it ``[b, s, a, d]``-contiguous, so the reshape
      is a view);
    * ``b·s·a/t``: the fused attention's logsumexp, instead of the ``s × s`` scores;
    * ``4·b·s·f/t``: the MLP's gate, silu(gate), up and their product (down_proj's input).

    Compare :func:`activation_bytes_per_layer` (16-bit, dropout, explicit scores).
    """
    replicated = 6 * b * s * h + 2 * b * s
    sharded = (4 * b * s * h + b * s * a + 4 * b * s * f) // t
    if sequence_parallel:
        replicated //= t
    return (replicated + sharded) * dtype_bytes
