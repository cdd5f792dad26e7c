"""The Triton PagedAttention kernel against the PyTorch reference, and the engine's dispatch.

On a GPU the kernel runs on CUDA; without one it runs in Triton's interpreter (the root
conftest sets ``TRITON_INTERPRET=1`` before triton is imported; this module sets it too when run
alone). Shapes are tiny: the interpreter executes every program in numpy. Skipped only on
platforms the ``kernels`` extra does not cover; where it does, a missing triton fails the import.
"""

import os
import random

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
import llmlab.kernels.paged_attention as kpa  # noqa: E402
from llmlab.inference import LLM, SamplingParams  # noqa: E402
from llmlab.inference import paged_attention as ipa  # noqa: E402
from llmlab.inference.paged_attention import (  # noqa: E402
    paged_attention_reference,
    slot_mapping,
    write_kv,
)
from llmlab.model.config import get_preset  # noqa: E402

BF16_INTERPRETER = (
    "Triton 3.9's interpreter multiplies bf16 tl.dot operands as their raw uint16 "
    "bits (interpreter.py create_dot); bf16 is checked on GPU"
)


@pytest.fixture(autouse=True)
def kernels_default():
    if DEV == "cpu" and not kpa.INTERPRETED:
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set: set it in the "
            "environment (or in the root conftest.py) or run this file alone"
        )
    old = K.disable()
    yield
    K.enable(**vars(old))


def make_case(
    block_size,
    H,
    Hkv,
    D,
    ctx_lens,
    query_lens,
    dtype=torch.float32,
    seed=0,
    share_first_block=False,
    strided=False,
):
    """Random K/V written through shuffled block tables (padded with junk block ids), and the
    step's queries. ``share_first_block``: sequences 0 and 1 (equal prefixes) use the same first
    block, as prefix caching does. ``strided``: caches, queries and tables non-contiguous."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    nblk = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(nblk) + 3
    if strided:  # K and V interleaved in one buffer: cache strides are not contiguous ones
        kv = torch.zeros(num_blocks, block_size, Hkv, 2, D, dtype=dtype, device=DEV)
        k_cache, v_cache = kv[:, :, :, 0], kv[:, :, :, 1]  # built on DEV: .to() would copy
    else:
        k_cache = torch.zeros(num_blocks, block_size, Hkv, D, dtype=dtype, device=DEV)
        v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, first = [], None
    for s, (ctx, nb) in enumerate(zip(ctx_lens, nblk)):
        table = [free.pop() for _ in range(nb)]
        if share_first_block and s == 1:
            free.append(table[0])
            table[0] = first
        first = first if first is not None else table[0]
        k = torch.randn(ctx, Hkv, D, generator=g).to(dtype)
        v = torch.randn(ctx, Hkv, D, generator=g).to(dtype)
        if share_first_block and s == 1:  # the shared block holds sequence 0's tokens
            n = min(block_size, ctx)
            k[:n] = k_cache.reshape(-1, Hkv, D)[first * block_size : first * block_size + n].cpu()
            v[:n] = v_cache.reshape(-1, Hkv, D)[first * block_size : first * block_size + n].cpu()
        write_kv(
            k_cache,
            v_cache,
            k.to(DEV),
            v.to(DEV),
            torch.tensor(slot_mapping(table, range(ctx), block_size), device=DEV),
        )
        tables.append(table)
    width = max(nblk) + 1
    bt = torch.tensor([t + [rng.randrange(num_blocks) for _ in range(width - len(t))] for t in tables])
    N = sum(query_lens)
    q = torch.randn(N, H, D, generator=g).to(dtype)
    if strided:
        q = torch.randn(N, D, H, generator=g).to(dtype).transpose(1, 2)
        bt = bt.t().contiguous().t()
    args = [q, k_cache, v_cache, bt, torch.tensor(ctx_lens), torch.tensor(query_lens)]
    return [a.to(DEV) for a in args]


def ragged(bs):
    return [1, bs - 1, bs, bs + 1, 3 * bs + 5]


@pytest.mark.parametrize(
    "block_size,H,Hkv,D,block_n",
    [
        (8, 2, 2, 32, 16),  # MHA, block_n spans two cache blocks
        (16, 8, 2, 64, 64),  # GQA, 4 query heads per KV head
        (32, 4, 1, 128, 16),  # MQA, block_n covers half a block
        (16, 4, 2, 16, 32),  # the tiny preset's head_dim
    ],
)
def test_decode_matches_reference(block_size, H, Hkv, D, block_n):
    ctx = ragged(block_size)
    args = make_case(block_size, H, Hkv, D, ctx, [1] * len(ctx), seed=D)
    out = kpa.paged_attention_triton(*args, block_n=block_n)
    torch.testing.assert_close(out, paged_attention_reference(*args), rtol=1e-5, atol=1e-5)


def test_prefill_and_mixed_step_match_reference():
    # full prompt, a chunk after cached tokens, decode tokens, a prompt longer than BLOCK_M rows
    ctx, qlens = [9, 21, 1, 8, 40], [9, 5, 1, 1, 33]
    args = make_case(8, 4, 2, 32, ctx, qlens, seed=3)
    out = kpa.paged_attention_triton(*args, block_n=16)
    torch.testing.assert_close(out, paged_attention_reference(*args), rtol=1e-5, atol=1e-5)
    out = kpa.paged_attention_triton(*args, scale=0.3, block_n=32)
    torch.testing.assert_close(out, paged_attention_reference(*args, scale=0.3), rtol=1e-5, atol=1e-5)


def test_shared_block_and_strided_inputs():
    args = make_case(8, 4, 2, 32, [11, 13, 5], [1, 1, 1], seed=5, share_first_block=True, strided=True)
    q, k_cache, _, bt = args[:4]
    assert bt[0, 0] == bt[1, 0] and not k_cache.is_contiguous() and not q.is_contiguous()
    assert bt.stride() != bt.contiguous().stride()
    out = kpa.paged_attention_triton(*args, block_n=16)
    torch.testing.assert_close(out, paged_attention_reference(*args), rtol=1e-5, atol=1e-5)
    # the two sequences sharing a block still differ (their own keys after the shared block)
    assert not torch.allclose(out[0], out[1])


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEV == "cpu", reason=BF16_INTERPRETER)),
    ],
)
def test_half_precision(dtype):
    args = make_case(16, 4, 2, 32, [3, 17, 40], [1, 1, 6], dtype=dtype, seed=7)
    out = kpa.paged_attention_triton(*args, block_n=32)
    assert out.dtype == dtype
    ref = paged_attention_reference(*[a.float() if a.is_floating_point() else a for a in args])
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_clear_errors():
    q, kc, vc, bt, ctx, ql = make_case(8, 4, 2, 32, [3, 9], [1, 1])
    f = kpa.paged_attention_triton
    bad_d = torch.zeros(2, 4, 48, device=DEV), torch.zeros(4, 8, 2, 48, device=DEV)
    with pytest.raises(ValueError, match=r"head_dim=48 must be a power of two in \[16, 256\]"):
        f(bad_d[0], bad_d[1], bad_d[1], bt, ctx, ql)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        kv3 = torch.zeros(4, 8, 3, 32, device=DEV)
        f(q, kv3, kv3, bt, ctx, ql)
    with pytest.raises(ValueError, match="cache head_dim=64 must equal the query head_dim=32"):
        kv64 = torch.zeros(4, 8, 2, 64, device=DEV)
        f(q, kv64, kv64, bt, ctx, ql)
    with pytest.raises(ValueError, match="must be one of float32, float16, bfloat16"):
        f(q.double(), kc, vc, bt, ctx, ql)
    with pytest.raises(ValueError, match="block_tables must be int32 or int64"):
        f(q, kc, vc, bt.float(), ctx, ql)
    with pytest.raises(ValueError, match="same S"):
        f(q, kc, vc, bt, ctx[:1], ql)
    with pytest.raises(ValueError, match="block_n=8 must be a power of two >= 16"):
        f(q, kc, vc, bt, ctx, ql, block_n=8)


@pytest.mark.skipif(DEV != "cpu", reason="CPU-only behaviour")
def test_cpu_tensors_outside_interpreter_refused(monkeypatch):
    monkeypatch.setattr(kpa, "INTERPRETED", False)
    args = make_case(8, 2, 2, 16, [3], [1])
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        kpa.paged_attention_triton(*args)


def test_dispatch_rule(monkeypatch):
    args = make_case(8, 4, 2, 32, [5, 12], [1, 1], seed=9)
    ref = paged_attention_reference(*args)
    calls = []
    orig = kpa.paged_attention_triton
    monkeypatch.setattr(kpa, "paged_attention_triton", lambda *a: calls.append(1) or orig(*a))
    # default "auto": Triton on CUDA tensors, the reference on CPU tensors (even interpreted)
    torch.testing.assert_close(ipa.paged_attention(*args), ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == (1 if DEV == "cuda" else 0)
    with K.use(paged_attention="triton"):  # CPU: the interpreter runs it
        torch.testing.assert_close(ipa.paged_attention(*args), ref, rtol=1e-5, atol=1e-5)
    with K.use(paged_attention="reference"):
        torch.testing.assert_close(ipa.paged_attention(*args), ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == (2 if DEV == "cuda" else 1)
    # "auto" leaves shapes the kernel cannot take to the reference
    assert not ipa.kernel_supports(torch.zeros(1, 1, 48), torch.zeros(1, 1, 1, 48))
    assert not ipa.kernel_supports(
        torch.zeros(1, 1, 32, dtype=torch.float64), torch.zeros(1, 1, 1, 32, dtype=torch.float64)
    )
    assert ipa.kernel_supports(torch.zeros(1, 1, 16), torch.zeros(1, 1, 1, 16))
    # the environment convention of llmlab.kernels
    assert K._from_env("0") == K.KernelSettings(paged_attention="reference")
    assert K._from_env("paged_attention=triton,rmsnorm").paged_attention == "triton"
    with pytest.raises(ValueError, match="paged_attention=<auto|triton|reference>"):
        K._from_env("paged_attention=cuda")
    with pytest.raises(ValueError, match="paged_attention='cuda' must be one of"):
        K.enable(paged_attention="cuda")


def test_engine_with_kernel_generates_what_the_reference_does(monkeypatch):
    """The whole engine (prefill, decode, a prompt longer than a block) through the kernel."""
    cfg = get_preset("tiny", num_hidden_layers=2, initializer_range=0.2)  # head_dim 16
    prompts = ["ROMEO:", "a", "JULIET: O Romeo"]
    sp = SamplingParams(temperature=0, max_tokens=4)
    with K.use(paged_attention="reference"):
        want = [o.outputs[0].token_ids for o in LLM(cfg, device=DEV, block_size=8).generate(prompts, sp)]
    calls = []
    orig = kpa.paged_attention_triton
    monkeypatch.setattr(kpa, "paged_attention_triton", lambda *a: calls.append(1) or orig(*a))
    with K.use(paged_attention="triton"):
        got = [o.outputs[0].token_ids for o in LLM(cfg, device=DEV, block_size=8).generate(prompts, sp)]
    assert got == want
    assert len(calls) >= 2 * 4  # two layers x (prefill + 3 decode steps)


COMPILE_FOR_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmlab.kernels.paged_attention import _paged_attention, INTERPRETED
assert not INTERPRETED
names = _paged_attention.arg_names
for dt, (group, bs, bm, bn, d) in (("*bf16", (2, 8, 16, 64, 32)),):
    const = dict(GROUP=group, BLOCK_SIZE=bs, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d,
                 PRECISION="ieee" if dt == "*fp32" else "tf32")
    sig = {n: "constexpr" if n in const else dt if n in ("Q", "KC", "VC", "O") else
           "*i64" if n in ("TABLES", "CTX", "QLEN", "QSTART") else
           "fp32" if n == "sm_scale" else "i32" for n in names}
    src = ASTSource(_paged_attention, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    assert len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]) > 1000
print("compiled")
"""


@pytest.mark.skipif(DEV != "cpu", reason="on GPU the kernel runs for real")
def test_kernel_compiles_for_hopper_without_a_gpu(tmp_path):
    """What the interpreter cannot see (layouts, tl.dot shapes, loop bounds): the kernel goes
    through Triton's real compiler to an sm_90 cubin (ptxas ships with triton)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def test_engine_step_with_prompt_and_decodes_is_one_kernel_call_per_layer(monkeypatch):
    """A request arriving while others decode makes a mixed step; the kernel takes the whole step
    in one call per layer (no padding to split around) and the tokens equal the reference's."""
    from llmlab.inference import LLMEngine

    cfg = get_preset("tiny", num_hidden_layers=2, initializer_range=0.2)

    def run(impl):
        with K.use(paged_attention=impl):
            eng = LLMEngine(cfg, device=DEV, block_size=8)
            sp = SamplingParams(temperature=0, max_tokens=5)
            eng.add_request("ROMEO:", sp, request_id="a")
            eng.add_request("a", sp, request_id="b")
            eng.step(), eng.step()
            eng.add_request("JULIET: O Romeo, Romeo", sp, request_id="c")  # joins two decodes
            while eng.has_unfinished_requests():
                eng.step()
            mixed = [m for m in eng.step_metrics if 0 < m.num_prefill_tokens < m.num_batched_tokens]
            return [eng.get_output(r).outputs[0].token_ids for r in "abc"], len(eng.step_metrics), mixed

    want, _, _ = run("reference")
    calls = []
    orig = kpa.paged_attention_triton
    monkeypatch.setattr(kpa, "paged_attention_triton", lambda *a: calls.append(1) or orig(*a))
    got, steps, mixed = run("triton")
    assert got == want and mixed
    assert len(calls) == 2 * steps
