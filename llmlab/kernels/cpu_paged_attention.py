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
``pip install "llmlab[cpu-kernels]"`` installs; about 40 s once, then cached under
``~/.cache/torch_extensions``). :func:`available` says whether it can be built here without
building it. Select it with ``llmlab.kernels.enable(paged_attention="cpu")`` or
``LLMLAB_KERNELS=paged_attention=cpu``; ``tests/test_cpu_paged_attention.py`` checks it against
the reference (fp32 to 1e-5; bf16 and fp16 to their rounding), in the engine too.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
# Reassociating float sums (and only that: no finite-math or reciprocal shortcuts) lets the dot
# products and the softmax sum reduce as a tree of vector adds instead of one lane at a time.
FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])


def available() -> bool:
    """Whether the kernel can be built here: a C++ compiler on ``PATH`` (``$CXX``, ``c++``,
    ``g++`` or ``clang++``) and the ``ninja`` package (the builder needs both)."""
    cxx = os.environ.get("CXX")
    has_cxx = any(shutil.which(c) for c in ([cxx] if cxx else []) + ["c++", "g++", "clang++"])
    return has_cxx and importlib.util.find_spec("ninja") is not None


@functools.cache
def _module():
    if not available():
        raise RuntimeError("the CPU PagedAttention kernel needs a C++ compiler and the ninja package "
                           "(pip install ninja); or use paged_attention='reference'")
    from torch.utils.cpp_extension import load
    tag = hashlib.sha1(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:10]
    return load(name=f"llmlab_paged_attention_cpu_{tag}", sources=[str(SOURCE)],
                extra_cflags=FLAGS, verbose=False)


def build() -> None:
    """Compile (or load the cached build of) the kernel now; raises ``RuntimeError`` where
    :func:`available` is False and the compiler's error where the build fails."""
    _module()


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        query_lens: torch.Tensor, scale: float | None = None,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of the step's new tokens over the paged cache, on CPU tensors.

    Arguments, shapes and result as :func:`llmlab.inference.paged_attention.paged_attention_reference`:
    ``q [N, H, D]`` (head dimension contiguous), ``k_cache, v_cache [num_blocks, block_size, Hkv,
    D]`` of q's dtype (fp32, bf16 or fp16), ``block_tables [S, max_blocks]``, ``context_lens [S]``,
    ``query_lens [S]`` summing to N; returns ``[N, H, D]`` in q's dtype (fp32 arithmetic inside).
    Raises ``RuntimeError`` naming the constraint for shapes, dtypes or lengths that do not fit
    (``query_len`` outside ``[1, context_len]``, a block table too short, H not a multiple of
    Hkv), and where the kernel cannot be built (:func:`available`)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _module().paged_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, query_lens,
                                         scale, -1 if sliding_window is None else int(sliding_window))
