"""PagedAttention decode: the Triton kernel against the PyTorch reference, side by side.

    PYTHONPATH=$PWD python benchmarks/bench_paged_attention.py            # GPU: timings
    PYTHONPATH=$PWD python benchmarks/bench_paged_attention.py --quick    # fewer shapes

On CUDA: for a decode batch (default 64 sequences, one new token each, shuffled block tables,
the ``small`` preset's heads: 8 query heads, 4 KV heads, head_dim 32) and context lengths 128 to
2048, checks that both give the same output, then times each (``triton.testing.do_bench``,
median ms) and prints the reference/kernel ratio and the kernel's K/V read bandwidth in GB/s.
Without CUDA: checks kernel == reference on a tiny case in Triton's interpreter and says that
timing needs a GPU (the interpreter runs programs in numpy: its times mean nothing).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

GPU = torch.cuda.is_available()
if GPU and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: the interpreter is for correctness, not for timing")
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")    # before triton is first imported

from llmlab.inference.paged_attention import paged_attention_reference  # noqa: E402
from llmlab.kernels import triton_available  # noqa: E402


def decode_batch(num_seqs, context_len, block_size, H, Hkv, D, dtype, device, seed=0):
    """Random caches and queries for one decode step; every sequence has ``context_len``
    tokens (the new one included) in blocks drawn at random from the pool."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context_len // block_size)
    num_blocks = num_seqs * per_seq + 1
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=g)[:num_seqs * per_seq].view(num_seqs, per_seq)
    q = torch.randn(num_seqs, H, D, generator=g).to(device, dtype)
    ctx = torch.full((num_seqs,), context_len)
    qlens = torch.ones(num_seqs, dtype=torch.long)
    return [t.to(device) for t in (q, k_cache, v_cache, tables, ctx, qlens)]


def check_tiny() -> float:
    """Max |kernel - reference| on a tiny fp32 decode batch with ragged contexts."""
    from llmlab.kernels.paged_attention import paged_attention_triton
    dev = "cuda" if GPU else "cpu"
    q, kc, vc, bt, _, ql = decode_batch(3, 20, 8, 4, 2, 32, torch.float32, dev)
    ctx = torch.tensor([1, 9, 20], device=dev)
    out = paged_attention_triton(q, kc, vc, bt, ctx, ql, block_n=16)
    return (out - paged_attention_reference(q, kc, vc, bt, ctx, ql)).abs().max().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer context lengths")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", default="8,4,32", help="num_heads,num_kv_heads,head_dim")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--block-n", type=int, default=64, help="kernel's tokens per K/V tile")
    args = p.parse_args(argv)
    if not triton_available():
        print("triton is not installed (pip install triton==3.9.0): nothing to compare")
        return 0
    err = check_tiny()
    where = "CUDA" if GPU else "Triton's CPU interpreter"
    print(f"correctness, tiny fp32 decode batch on {where}: max |kernel - reference| = {err:.2e}")
    if err > 1e-5:
        print("FAILED: the kernel disagrees with the reference")
        return 1
    if not GPU:
        print("timing needs a CUDA GPU: none here, so kernel vs reference speed is not measured")
        return 0

    import triton.testing
    from llmlab.kernels.paged_attention import paged_attention_triton
    H, Hkv, D = map(int, args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    contexts = (128, 2048) if args.quick else (128, 256, 512, 1024, 2048)
    print(f"\n== decode on {torch.cuda.get_device_name()}: {args.num_seqs} seqs, H={H}, Hkv={Hkv}, "
          f"D={D}, block_size={args.block_size}, block_n={args.block_n}, {args.dtype} ==")
    print(f"{'context':>8} {'ref ms':>9} {'triton ms':>10} {'ref/triton':>11} {'kernel GB/s':>12} "
          f"{'max|diff|':>10}")
    for ctx_len in contexts:
        batch = decode_batch(args.num_seqs, ctx_len, args.block_size, H, Hkv, D, dtype, "cuda")
        ref = paged_attention_reference(*batch)
        out = paged_attention_triton(*batch, block_n=args.block_n)
        diff = (out.float() - ref.float()).abs().max().item()
        t_ref = triton.testing.do_bench(lambda: paged_attention_reference(*batch))
        t_tri = triton.testing.do_bench(lambda: paged_attention_triton(*batch, block_n=args.block_n))
        kv_bytes = 2 * args.num_seqs * ctx_len * Hkv * D * batch[1].element_size()
        print(f"{ctx_len:>8} {t_ref:>9.3f} {t_tri:>10.3f} {t_ref / t_tri:>10.2f}x "
              f"{kv_bytes / (t_tri * 1e-3) / 1e9:>12.1f} {diff:>10.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
