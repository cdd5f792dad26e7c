"""The CPU fast paths choose by what the CPU offers (llmlab.kernels.cpu_isa): the level read from
the flags, ``LLMLAB_CPU_ISA`` lowering it (never raising it), and each chooser refusing a fast path
on a flag set that cannot run it: the bf16/fp16 oneDNN packed linear on an AVX2-only CPU (AMD EPYC
7002/7003: PyTorch raises ``bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl
and avx512dq`` there; the weight is packed widened to fp32 instead), fp16 on an AVX-512 CPU without
AVX512-FP16 (likewise), and the C++ build's ``-march``."""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels import cpu_build, cpu_isa, cpu_linear

BASE = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "bmi1", "bmi2"}
EPYC_ZEN3 = frozenset(BASE | {"avx2", "fma", "f16c", "sha_ni", "vaes"})  # AVX2 only
EPYC_ZEN4 = frozenset(
    EPYC_ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"}
)  # no FP16
SKYLAKE_X = frozenset(EPYC_ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
SAPPHIRE = frozenset(EPYC_ZEN4 | {"avx512_fp16", "amx_bf16", "amx_tile"})


def test_levels_of_real_flag_sets():
    assert [cpu_isa.level_of(f) for f in (BASE, EPYC_ZEN3, SKYLAKE_X, EPYC_ZEN4, SAPPHIRE)] == [
        "generic",
        "avx2",
        "avx512",
        "avx512_bf16",
        "avx512_bf16",
    ]
    assert cpu_isa.level_of(EPYC_ZEN3 - {"fma"}) == "generic"  # AVX2 without FMA: not v3
    assert cpu_isa.detected() == cpu_isa.level_of(cpu_isa.cpu_flags())


@pytest.mark.parametrize(
    "dtype,flags,want",
    [
        (torch.bfloat16, EPYC_ZEN3, "onednn-fp32"),
        (torch.float16, EPYC_ZEN3, "onednn-fp32"),
        (torch.float32, EPYC_ZEN3, "onednn"),
        (torch.bfloat16, SKYLAKE_X, "onednn"),
        (torch.float16, EPYC_ZEN4, "onednn-fp32"),
        (torch.float16, SAPPHIRE, "onednn"),
        (torch.bfloat16, EPYC_ZEN3 | {"avx_ne_convert"}, "onednn"),
    ],
)
def test_packed_linear_refuses_what_the_flags_cannot_run(dtype, flags, want):
    assert cpu_linear.path(dtype, flags=flags) == want


def test_the_cxx_build_targets_the_level():
    assert "-march=x86-64-v3" in cpu_build.flags("avx2", native=False, x86=True)
    assert not any("native" in f or "512" in f for f in cpu_build.flags("avx2", native=False, x86=True))
    assert "-march=x86-64-v4" in cpu_build.flags("avx512", native=False, x86=True)
    assert "-march=x86-64" in cpu_build.flags("generic", native=False, x86=True)
    assert "-march=native" in cpu_build.flags("avx512_bf16", native=True, x86=True)
    assert not any(f.startswith("-march") for f in cpu_build.flags("generic", native=True, x86=False))


def test_the_override_lowers_and_never_raises(monkeypatch):
    monkeypatch.setattr(cpu_isa, "detected", lambda: "avx512_bf16")
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: SAPPHIRE)
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    assert cpu_isa.cpu_isa() == "avx2" and cpu_isa.lowered()
    assert cpu_isa.effective_flags() == EPYC_ZEN3  # AVX-512 and AMX gone
    assert cpu_linear.path(torch.bfloat16, flags=cpu_isa.effective_flags()) == "onednn-fp32"
    monkeypatch.setenv(cpu_isa.ENV, "avx512")
    assert cpu_isa.effective_flags() == SKYLAKE_X - {"avx512cd"}
    monkeypatch.setenv(cpu_isa.ENV, "generic")
    assert cpu_isa.level_of(cpu_isa.effective_flags()) == "generic"
    monkeypatch.setenv(cpu_isa.ENV, "avx3")
    with pytest.raises(ValueError, match="LLMLAB_CPU_ISA='avx3' must be one of generic, avx2"):
        cpu_isa.cpu_isa()
    monkeypatch.setattr(cpu_isa, "detected", lambda: "avx2")
    monkeypatch.setenv(cpu_isa.ENV, "avx512")
    with pytest.raises(ValueError, match=r"more than this CPU offers \(avx2\)"):
        cpu_isa.cpu_isa()
    monkeypatch.delenv(cpu_isa.ENV)
    assert cpu_isa.cpu_isa() == "avx2" and not cpu_isa.lowered()


def test_a_pinned_level_holds_until_the_block_ends_on_its_own_thread(monkeypatch):
    import threading

    monkeypatch.setattr(cpu_isa, "detected", lambda: "avx512_bf16")
    monkeypatch.setenv(cpu_isa.ENV, "avx512")
    seen = []
    with cpu_isa.pinned() as level:
        assert level == "avx512"
        monkeypatch.setenv(cpu_isa.ENV, "avx2")  # read on entry, not again inside
        assert cpu_isa.cpu_isa() == "avx512"
        with cpu_isa.pinned() as inner:  # nested: the current level, kept
            assert inner == "avx512"
        assert cpu_isa.cpu_isa() == "avx512"
        t = threading.Thread(target=lambda: seen.append(cpu_isa.cpu_isa()))  # another thread reads
        t.start()
        t.join()
    assert seen == ["avx2"] and cpu_isa.cpu_isa() == "avx2"
    monkeypatch.setenv(cpu_isa.ENV, "avx3")
    with pytest.raises(ValueError, match="must be one of"), cpu_isa.pinned():
        pass
    monkeypatch.delenv(cpu_isa.ENV)
    assert cpu_isa.cpu_isa() == "avx512_bf16"


def test_forcing_the_fallback_here_takes_it(monkeypatch):
    """On this machine, LLMLAB_CPU_ISA at the level below the current one: no packed path that
    level lacks (bf16 and fp16 weights are packed widened to fp32)."""
    low = cpu_isa.fallback()
    if low is None:  # nothing below generic
        assert cpu_isa.cpu_isa() == "generic"
        return
    monkeypatch.setenv(cpu_isa.ENV, low)
    assert cpu_isa.cpu_isa() == low
    for dtype in (torch.bfloat16, torch.float16):
        assert cpu_linear.path(dtype) == "onednn-fp32"
    assert cpu_linear.path(torch.float32) == "onednn"
