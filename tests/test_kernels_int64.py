"""Kernels address tensors past 2^31 elements with int64 offsets.

``row * stride`` in int32 wraps once it passes 2^31 (a long context or a large batch): the kernel
reads and writes somewhere else (on CPU, in Triton's interpreter, the process segfaults). These
tests view a few rows of a > 2^31-element buffer (``torch.empty`` does not touch its pages, so
the memory used is the rows') so that the offsets pass 2^31 while the kernels run only a few
programs; each runs in its own interpreter process, so a crash is a failure, not a lost session.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from llmlab.kernels import TRITON_MARKER, triton_platform  # does not import triton

if not triton_platform():  # by platform, as the kernels extra installs triton: never by import
    pytest.skip(
        f"the kernels extra has no triton for this platform ({TRITON_MARKER})", allow_module_level=True
    )

PRELUDE = """
import os
os.environ.setdefault("TRITON_INTERPRET", "1") if not os.path.exists("/dev/nvidia0") else None
import torch
DEV = "cuda" if torch.cuda.is_available() else "cpu"
STRIDE = 2**30          # row i starts at i * 2^30: row 2 at 2^31, past int32

def rows_past_2_31(n_rows, width, dtype=torch.float16, seed=0):
    store = torch.empty((n_rows - 1) * STRIDE + width, dtype=dtype, device=DEV)
    view = store.as_strided((n_rows, width), (STRIDE, 1))
    vals = torch.randn(n_rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)
    view.copy_(vals.to(DEV))
    return view, vals
"""


def _run(body: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}: {proc.stderr[-1500:]}"
    return proc.stdout


def test_rmsnorm_rows_past_2_31_elements():
    out = _run("""
        from llmlab.kernels.fused_rmsnorm import rms_norm
        from llmlab.kernels.reference import rms_norm_reference
        x, vals = rows_past_2_31(3, 64)
        x.requires_grad_()
        w = torch.ones(64, dtype=torch.float16, device=DEV, requires_grad=True)
        y = rms_norm(x, w)
        dy = torch.ones_like(y)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        x32 = vals.float().requires_grad_()
        w32 = torch.ones(64, requires_grad=True)
        ref = rms_norm_reference(x32, w32)
        rdx, rdw = torch.autograd.grad(ref, (x32, w32), torch.ones_like(ref))
        print(max((y.float().cpu() - ref).abs().max().item(), (dx.float().cpu() - rdx).abs().max().item(),
                  (dw.float().cpu() - rdw).abs().max().item()))
    """)
    assert float(out.split()[-1]) < 2e-2


def test_flash_attention_batch_offsets_past_2_31_elements():
    out = _run("""
        from llmlab.kernels.flash_attention import flash_attention
        from llmlab.kernels.reference import attention_reference
        B, T, D = 3, 16, 16
        qkv = []
        for seed in range(3):   # [B, 1, T, D] with batch b starting at b * 2^30
            flat, vals = rows_past_2_31(B, T * D, seed=seed)
            qkv.append((flat.as_strided((B, 1, T, D), (STRIDE, T * D, D, 1)), vals.view(B, 1, T, D)))
        (q, q0), (k, k0), (v, v0) = qkv
        for t in (q, k, v):
            t.requires_grad_()
        o = flash_attention(q, k, v, block_m=16, block_n=16)
        grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        r = [t.float().requires_grad_() for t in (q0, k0, v0)]
        ro = attention_reference(*r)
        rgrads = torch.autograd.grad(ro, r, torch.ones_like(ro))
        errs = [(o.float().cpu() - ro).abs().max().item()]
        errs += [(a.float().cpu() - b).abs().max().item() for a, b in zip(grads, rgrads)]
        print(max(errs))
    """)
    assert float(out.split()[-1]) < 3e-2


COMPILE_FOR_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmlab.kernels import flash_attention as fa, fused_rmsnorm as rn, fused_swiglu as sw
FP32_PTRS = {"LSE", "DELTA", "RSTD", "DW_PART"}
FP16_PTRS = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ", "X", "W", "Y", "DY", "DX", "G", "U", "DG", "DU"}
def compile_(kernel, const):
    names = kernel.arg_names
    sig = {n: "constexpr" if n in const else "*fp32" if n in FP32_PTRS else
           "*fp16" if n in FP16_PTRS else "fp32" if n in ("sm_scale", "eps") else "i32" for n in names}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    assert len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]) > 1000
att = dict(CAUSAL=True, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, PRECISION="tf32")
for k in (fa._fwd, fa._bwd_dkdv, fa._bwd_dq):
    compile_(k, att)
compile_(rn._rms_fwd, dict(BLOCK_N=1024))
compile_(rn._rms_bwd, dict(BLOCK_N=1024))
compile_(sw._swiglu_fwd, dict(BLOCK=1024))
compile_(sw._swiglu_bwd, dict(BLOCK=1024))
print("compiled")
"""


def test_int64_offset_kernels_compile_for_hopper(tmp_path):
    """The interpreter does not type-check like the compiler: the int64 casts go through Triton's
    real compiler to sm_90 cubins (ptxas ships with triton), swiglu's included (past 2^31
    elements it needs a GPU to run)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
