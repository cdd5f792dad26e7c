"""Measurements for the kernels: attention memory against sequence length, and GPU speed.

* :func:`attention_memory` (any device): bytes autograd saves for backward
  (:class:`llmlab.metrics.memory.SavedActivations`), and on CUDA the allocator's peak during
  forward + backward, for each attention implementation and sequence length, next to the
  formulas: O(T²) with the scores materialised, O(T) for FlashAttention.
* :func:`bench_attention`, :func:`bench_rmsnorm`, :func:`bench_swiglu` (CUDA only, else
  ``RuntimeError``): median time of forward and forward + backward, achieved TFLOP/s (attention)
  or GB/s (memory-bound RMSNorm/SwiGLU) and the fraction of the device's peak, against PyTorch
  eager and SDPA / ``F.rms_norm``. Never run them under ``TRITON_INTERPRET=1``.

FLOPs of attention (FlashAttention-2 paper's convention, Dao 2023, §4.1): forward
``4·B·H·T²·D`` (two matmuls), halved when causal; backward 2.5× the forward (five matmuls with
the recomputation), so forward + backward is 3.5× the forward.
"""

from __future__ import annotations

import statistics

import torch

from llmlab.kernels import attention as _attention
from llmlab.kernels.reference import rms_norm_reference, swiglu_reference
from llmlab.metrics.memory import SavedActivations
from llmlab.metrics.throughput import peak_flops

# Peak HBM bandwidth in bytes/s by device name fragment (vendor data sheets).
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100": 3.35e12,
    "A100": 2.0e12,
    "L40S": 0.864e12,
    "A10": 0.6e12,
    "V100": 0.9e12,
    "T4": 0.32e12,
    "4090": 1.008e12,
    "3090": 0.936e12,
}


def peak_bandwidth(device=None) -> float | None:
    """Peak memory bandwidth (bytes/s) of a known CUDA GPU, ``None`` on CPU or unknown."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)


def attention_flops(B: int, H: int, T: int, D: int, causal: bool = True, backward: bool = False) -> float:
    """FLOPs of attention's matmuls: forward ``4·B·H·T²·D`` (/2 causal), ×3.5 with backward."""
    f = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
    return f * 3.5 if backward else f


def attention_memory(
    seq_lens,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 32,
    impls=("eager", "reference"),
    device="cpu",
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """Memory of one attention forward + backward per implementation and sequence length.

    Returns rows ``{"impl", "seq_len", "saved_bytes", "formula_bytes", "peak_bytes"}``:
    ``saved_bytes`` measured by saved-tensor hooks; ``formula_bytes`` the count from the
    algorithm (materialised: fp32 probabilities ``4·B·H·T²``, the bool causal mask ``T²`` and the
    fp32 ``q, k, v`` ``3·4·B·H·T·D``; flash: ``4·B·H·T·D·e + 4·B·H·T`` for ``q, k, v, out`` and
    the fp32 log-sum-exp); the ``sdpa`` row reuses the flash formula (PyTorch's fused kernels
    save the same);
    ``peak_bytes`` the CUDA allocator's peak above the inputs (``None`` on CPU).
    ``impls`` from ``"eager"``, ``"reference"``, ``"sdpa"``, ``"triton"``.
    """
    rows = []
    cuda = torch.device(device).type == "cuda"
    e = torch.empty((), dtype=dtype).element_size()
    for T in seq_lens:
        g = torch.Generator().manual_seed(T)
        q, k, v = [
            torch.randn(batch, heads, T, head_dim, generator=g).to(device, dtype).requires_grad_()
            for _ in range(3)
        ]
        for impl in impls:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            with SavedActivations() as act:
                out = _attention(q, k, v, causal=True, impl=impl)
            out.backward(torch.ones_like(out))
            peak = torch.cuda.max_memory_allocated() - base if cuda else None
            del out
            q.grad = k.grad = v.grad = None
            flash = impl in ("reference", "triton", "sdpa")
            bhtd = batch * heads * T * head_dim
            formula = (
                4 * bhtd * e + 4 * batch * heads * T
                if flash  # q, k, v, out, lse
                else 4 * batch * heads * T * T + T * T + 3 * bhtd * 4
            )  # p, mask, fp32 q k v
            rows.append(
                {
                    "impl": impl,
                    "seq_len": T,
                    "saved_bytes": act.peak,
                    "formula_bytes": formula,
                    "peak_bytes": peak,
                }
            )
    return rows


def time_cuda(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _need_cuda():
    if not torch.cuda.is_available():
        raise RuntimeError("no GPU: GPU benchmarks need CUDA (Triton's interpreter is not for timing)")


def _fwd_bwd(fn, inputs):
    def run():
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        for t in inputs:
            t.grad = None

    return run


def bench_attention(
    shapes=((4, 16, 1024, 64), (4, 16, 4096, 64), (1, 16, 8192, 128)),
    impls=("eager", "sdpa", "triton"),
    dtype=torch.bfloat16,
) -> list[dict]:
    """Time causal attention ``(B, H, T, D)`` forward and forward + backward on CUDA.

    Rows: ``impl, shape, fwd_ms, fwd_bwd_ms, fwd_tflops, fwd_bwd_tflops, fwd_peak_frac,
    speedup_vs_eager`` (fwd + bwd). ``eager`` is skipped (``None``) where the ``[T, T]`` scores
    would exceed 8 GiB. Raises ``RuntimeError`` without CUDA.
    """
    _need_cuda()
    peak = peak_flops()
    rows = []
    for B, H, T, D in shapes:
        q, k, v = [torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]
        base = None
        for impl in impls:
            if impl == "eager" and B * H * T * T * 4 > 8 * 2**30:
                rows.append({"impl": impl, "shape": (B, H, T, D), "fwd_ms": None})
                continue
            fn = lambda q, k, v, impl=impl: _attention(q, k, v, causal=True, impl=impl)  # noqa: E731
            with torch.no_grad():
                t_f = time_cuda(lambda: fn(q, k, v))
            t_fb = time_cuda(_fwd_bwd(fn, (q, k, v)))
            f, fb = attention_flops(B, H, T, D), attention_flops(B, H, T, D, backward=True)
            base = t_fb if impl == "eager" else base
            rows.append(
                {
                    "impl": impl,
                    "shape": (B, H, T, D),
                    "fwd_ms": t_f * 1e3,
                    "fwd_bwd_ms": t_fb * 1e3,
                    "fwd_tflops": f / t_f / 1e12,
                    "fwd_bwd_tflops": fb / t_fb / 1e12,
                    "fwd_peak_frac": f / t_f / peak if peak else None,
                    "speedup_vs_eager": base / t_fb if base else None,
                }
            )
    return rows


def _bench_memory_bound(name, impls, make_inputs, bytes_fwd, bytes_fwd_bwd, shapes):
    _need_cuda()
    bw = peak_bandwidth()
    rows = []
    for shape in shapes:
        inputs = make_inputs(shape)
        base = None
        for impl, fn in impls.items():
            with torch.no_grad():
                t_f = time_cuda(lambda: fn(*inputs))
            t_fb = time_cuda(_fwd_bwd(fn, inputs))
            base = t_fb if base is None else base
            bf, bfb = bytes_fwd(shape), bytes_fwd_bwd(shape)
            rows.append(
                {
                    "op": name,
                    "impl": impl,
                    "shape": tuple(shape),
                    "fwd_ms": t_f * 1e3,
                    "fwd_bwd_ms": t_fb * 1e3,
                    "fwd_gbps": bf / t_f / 1e9,
                    "fwd_bwd_gbps": bfb / t_fb / 1e9,
                    "fwd_peak_frac": bf / t_f / bw if bw else None,
                    "speedup_vs_eager": base / t_fb,
                }
            )
    return rows


def bench_rmsnorm(shapes=((8192, 4096), (16384, 8192)), dtype=torch.bfloat16) -> list[dict]:
    """Time RMSNorm ``[rows, N]`` on CUDA: eager (the model's maths), ``F.rms_norm``, Triton.

    GB/s counts the minimum traffic: forward reads ``x`` and writes ``y`` (``2·rows·N·e``),
    backward reads ``x, dy`` and writes ``dx`` (``3·rows·N·e``). Raises ``RuntimeError``
    without CUDA.
    """
    _need_cuda()
    from llmlab.kernels.fused_rmsnorm import rms_norm

    e = torch.empty((), dtype=dtype).element_size()

    def make(shape):
        return (
            torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True),
            torch.ones(shape[-1], device="cuda", dtype=dtype, requires_grad=True),
        )

    impls = {
        "eager": lambda x, w: rms_norm_reference(x, w, 1e-5),
        "F.rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-5),
        "triton": lambda x, w: rms_norm(x, w, 1e-5),
    }
    return _bench_memory_bound(
        "rmsnorm", impls, make, lambda s: 2 * s[0] * s[1] * e, lambda s: 5 * s[0] * s[1] * e, shapes
    )


def bench_swiglu(shapes=((8192, 11008), (16384, 14336)), dtype=torch.bfloat16) -> list[dict]:
    """Time ``silu(gate) * up`` on ``[tokens, ffn]`` on CUDA: eager against Triton.

    GB/s: forward reads 2 and writes 1 tensor (``3·n·e``); backward reads 3 and writes 2
    (``5·n·e``). Raises ``RuntimeError`` without CUDA.
    """
    _need_cuda()
    from llmlab.kernels.fused_swiglu import swiglu

    e = torch.empty((), dtype=dtype).element_size()

    def make(shape):
        return tuple(torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))

    n = lambda s: s[0] * s[1]  # noqa: E731
    return _bench_memory_bound(
        "swiglu",
        {"eager": swiglu_reference, "triton": swiglu},
        make,
        lambda s: 3 * n(s) * e,
        lambda s: 8 * n(s) * e,
        shapes,
    )


def format_rows(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table of ``rows`` (floats with 3 significant digits, ``None`` as ``-``)."""

    def cell(x):
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.3g}"
        return str(x)

    table = [columns] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table)


# ATen ops that only allocate or re-view memory: no GPU kernel is launched for them.
_NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "view",
    "_unsafe_view",
    "reshape",
    "as_strided",
    "detach",
    "t",
    "transpose",
    "expand",
    "alias",
    "unsqueeze",
    "squeeze",
    "permute",
    "slice",
    "select",
    "split",
    "lift_fresh",
    "_to_copy_noop",
}


def count_aten_kernels(fn, *args) -> int:
    """Number of ATen compute ops ``fn(*args)`` dispatches (forward, and backward if it calls
    ``.backward``), allocation and view ops excluded: on a GPU each is one kernel launch reading
    its inputs from and writing its output to HBM. A Triton kernel launch is not an ATen op and is
    not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _NO_KERNEL:
                _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn(*args)
    return _Count.n
