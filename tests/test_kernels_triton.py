"""Triton kernels against their PyTorch references: on a GPU if there is one, else on CPU
through Triton's interpreter.

``TRITON_INTERPRET=1`` must be in the environment before ``triton`` is first imported (Triton's
own ``tl.zeros``... are ``@triton.jit`` functions built at import time), so this module sets it
before importing triton when no GPU is present. If another test module imports triton first in
the same session, the fixture fails with that explanation: set it in the environment or in the
root ``conftest.py``. Shapes are tiny: the interpreter runs every program
in numpy, slowly. Skipped only on platforms the ``kernels`` extra does not cover (Python 3.10,
macOS, ARM); where it does, a missing triton fails the import.
"""

import importlib
import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
from llmlab.kernels import TRITON_MARKER, triton_platform  # noqa: E402  (does not import triton)

if not triton_platform():
    pytest.skip(
        f"the kernels extra has no triton for this platform ({TRITON_MARKER})", allow_module_level=True
    )
import triton  # noqa: E402, F401  (installed by the dev/kernels extras here: missing is a failure)

import llmlab.kernels as K  # noqa: E402
from llmlab.kernels.reference import (  # noqa: E402
    attention_reference,
    rms_norm_reference,
    swiglu_reference,
)
from llmlab.model.config import get_preset  # noqa: E402
from llmlab.model.llama import LlamaForCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def tk():
    """The three kernel modules (built for the interpreter on CPU)."""
    mods = {
        name: importlib.import_module(f"llmlab.kernels.{name}")
        for name in ("flash_attention", "fused_rmsnorm", "fused_swiglu")
    }
    if DEV == "cpu" and not all(m.INTERPRETED for m in mods.values()):
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set: set it in the "
            "environment (or in the root conftest.py) or run this file alone"
        )
    K.disable()
    yield mods
    K.disable()


def _check_grads(out, ref, inputs, atol=2e-5, rtol=1e-4):
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEV)
    for a, b in zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(ref, inputs, dout)):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "B,H,Hk,T,D,causal",
    [
        (1, 2, 1, 37, 16, True),  # GQA; 37 = 2·16 + 5: partial last tile in both loops
        (2, 1, 1, 16, 8, True),  # exactly one tile; head_dim 8 padded to 16
        (1, 1, 1, 20, 12, False),  # non-causal, non power-of-two head_dim
    ],
)
def test_triton_flash_attention_matches_reference(tk, B, H, Hk, T, D, causal):
    g = torch.Generator().manual_seed(T)
    q, k, v = [torch.randn(B, h, T, D, generator=g).to(DEV).requires_grad_() for h in (H, Hk, Hk)]
    out = tk["flash_attention"].flash_attention(q, k, v, causal, block_m=16, block_n=16)
    _check_grads(out, attention_reference(q, k, v, causal), (q, k, v))


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                DEV == "cpu",
                reason="Triton's interpreter multiplies bf16 tl.dot operands as their raw "
                "uint16 bits (interpreter.py create_dot); bf16 is checked on GPU",
            ),
        ),
    ],
)
def test_triton_flash_attention_half_precision(tk, dtype):
    g = torch.Generator().manual_seed(5)
    q, k, v = [torch.randn(1, 2, 20, 16, generator=g).to(DEV, dtype).requires_grad_() for _ in range(3)]
    out = tk["flash_attention"].flash_attention(q, k, v, block_m=16, block_n=16)
    assert out.dtype == dtype
    ref = attention_reference(q, k, v)  # fp32 maths on the same inputs
    dout = torch.ones_like(out)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_rmsnorm_swiglu_half_precision(tk, dtype):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 48, generator=g).to(DEV, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(DEV, dtype).requires_grad_()
    y, ref = tk["fused_rmsnorm"].rms_norm(x, w), rms_norm_reference(x, w)
    assert y.dtype == dtype
    _check_grads(y.float(), ref.float(), (x, w), atol=2e-2, rtol=2e-2)
    u = torch.randn(5, 48, generator=g).to(DEV, dtype).requires_grad_()
    y, ref = tk["fused_swiglu"].swiglu(x, u), swiglu_reference(x, u)
    _check_grads(y.float(), ref.float(), (x, u), atol=2e-2, rtol=2e-2)


def test_triton_flash_attention_strided_input_and_errors(tk):
    fa = tk["flash_attention"]
    x = torch.randn(1, 19, 2, 16).to(DEV).requires_grad_()  # [B, T, H, D], viewed as [B, H, T, D]
    q = k = v = x.transpose(1, 2)
    out = fa.flash_attention(q, k, v, block_m=16, block_n=32)
    _check_grads(out, attention_reference(q, k, v), (x,))
    with pytest.raises(ValueError, match="block_m=8 must be a power of two >= 16"):
        fa.flash_attention(q, k, v, block_m=8)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=2"):
        kv = torch.zeros(1, 3, 19, 16, device=DEV)
        fa.flash_attention(q, kv, kv)
    with pytest.raises(ValueError, match="dtypes torch.float32, torch.float64, torch.float32"):
        fa.flash_attention(q, k.double(), v)


@pytest.mark.skipif(DEV != "cpu", reason="CPU-only behaviour")
def test_kernels_refuse_cpu_tensors_outside_interpreter(tk, monkeypatch):
    for name in tk:
        monkeypatch.setattr(tk[name], "INTERPRETED", False)
    x = torch.randn(1, 1, 16, 16)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        tk["flash_attention"].flash_attention(x, x, x)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        tk["fused_rmsnorm"].rms_norm(x, torch.ones(16))
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        tk["fused_swiglu"].swiglu(x, x)


@pytest.mark.parametrize("shape", [(3, 7, 40), (5, 64), (2, 1, 3)])
def test_triton_rmsnorm_matches_reference(tk, shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g).to(DEV).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEV).requires_grad_()
    _check_grads(tk["fused_rmsnorm"].rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), (x, w))
    with pytest.raises(ValueError, match="must be \\[N\\]"):
        tk["fused_rmsnorm"].rms_norm(x, torch.ones(shape[-1] + 1, device=DEV))


@pytest.mark.parametrize("shape", [(3, 7, 40), (1100,)])  # 1100 > BLOCK=1024: two programs
def test_triton_swiglu_matches_reference(tk, shape):
    g = torch.Generator().manual_seed(3)
    gate = (3 * torch.randn(shape, generator=g)).to(DEV).requires_grad_()
    up = torch.randn(shape, generator=g).to(DEV).requires_grad_()
    _check_grads(tk["fused_swiglu"].swiglu(gate, up), swiglu_reference(gate, up), (gate, up))
    with pytest.raises(ValueError, match="same shape and dtype"):
        tk["fused_swiglu"].swiglu(gate, up.double())


def test_model_with_all_triton_kernels_matches_default(tk):
    """The switch the model reads: same loss and gradients as SDPA + eager norm/activation."""
    model = LlamaForCausalLM(get_preset("tiny").replace(num_hidden_layers=2), seed=0).to(DEV)
    ids = torch.randint(0, 256, (1, 18), generator=torch.Generator().manual_seed(0)).to(DEV)

    def run():
        model.zero_grad()
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss0, grads0 = run()
    with pytest.MonkeyPatch.context() as mp:
        with K.use(attention="triton", rmsnorm=True, swiglu=True):
            assert all(K.use_fused(kind, ids) for kind in ("attention", "rmsnorm", "swiglu"))
            calls = []
            orig = tk["flash_attention"]._FlashAttention.apply
            mp.setattr(tk["flash_attention"]._FlashAttention, "apply", lambda *a: calls.append(1) or orig(*a))
            loss1, grads1 = run()
    assert len(calls) == 2  # one Triton call per layer
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-6, msg=n)
