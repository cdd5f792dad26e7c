"""PagedAttention for CPU tensors, in C++: the inference engine's fast path on CPU.

The PyTorch reference (:func:`llmlab.inference.paged_attention.paged_attention_reference`)
gathers every sequence's blocks into a padded copy and runs SDPA on it: on a CPU a decode step
then moves each cached K/V row three times (gather read, copy written, SDPA read) plus the
padding, and that traffic is most of the step. This kernel
(``llmlab/kernels/csrc/paged_attention_cpu.cpp``) walks each sequence's block table in place, as
vLLM's CPU and CUDA kernels do (Kwon et al., SOSP 2023, §4.1): one read of each row, scores and
softmax in fp32, GQA's query heads of one kv head sharing the reads. Prefill, chunked prefill
and decode rows go in one call.

It is compiled on first use with PyTorch's C++ extension builder
(:func:`torch.utils.cpp_extension.load`: a C++ compiler and the ``ninja`` package, which
``pip install "llmlab[cpu-kernels]"`` installs; about a minute once, then cached under
``~/.cache/torch_extensions``). :func:`available` says whether it can be built here without
building it. Select it with ``llmlab.kernels.enable(paged_attention="cpu")`` or
``LLMLAB_KERNELS=paged_attention=cpu``; ``tests/test_cpu_paged_attention.py`` checks it against
the reference (fp32 to 1e-5; bf16 and fp16 to their rounding), in the engine too.
"""

from __future__ import annotations

import torch

from llmlab.kernels.cpu_build import available  # noqa: F401  (re-exported: can it be built here)
from llmlab.kernels.cpu_build import compiled_isa, load

# The head dims the kernel is compiled for (its vectors hold 16 fp32 lanes).
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 256)


def _module():
    return load("paged_attention_cpu", "CPU PagedAttention kernel (or use paged_attention='reference')")


def isa() -> str:
    """The vector code the build for the current level uses (:func:`~llmlab.kernels.cpu_build.compiled_isa`:
    ``"avx512_bf16"``, ``"avx512"``, ``"avx2"`` or ``"generic"``); builds it if needed."""
    return compiled_isa("paged_attention_cpu", "CPU PagedAttention kernel")


def build() -> None:
    """Compile (or load the cached build of) the kernel now; raises ``RuntimeError`` where
    :func:`available` is False and the compiler's error where the build fails."""
    _module()


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over the paged cache, on CPU tensors.

    Arguments, shapes and result as :func:`llmlab.inference.paged_attention.paged_attention_reference`:
    ``q [N, H, D]`` (head dimension contiguous), ``k_cache, v_cache [num_blocks, block_size, Hkv,
    D]`` of q's dtype (fp32, bf16 or fp16), ``block_tables [S, max_blocks]``, ``context_lens [S]``,
    ``query_lens [S]`` summing to N; returns ``[N, H, D]`` in q's dtype (fp32 arithmetic inside).
    ``D`` must be one of :data:`HEAD_DIMS`. Raises ``RuntimeError`` naming the constraint for
    shapes, dtypes or lengths that do not fit (``query_len`` outside ``[1, context_len]``, a block
    table too short, H not a multiple of Hkv, another head dim), and where the kernel cannot be
    built (:func:`available`)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _module().paged_attention_cpu(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_lens,
        scale,
        -1 if sliding_window is None else int(sliding_window),
    )
