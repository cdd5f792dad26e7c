"""`llmlab doctor --selftest --quick`: every named check runs in its own process on this machine,
none fails, and the JSON report has the documented shape; a hung check is a FAIL."""

import json
import os
import time

import torch
import torch.nn.functional as F

from llmlab.cli import main
from llmlab.kernels import amx_linear, cpu_fused, cpu_isa, cpu_linear, cpu_paged_attention, panel_linear
from llmlab.selftest import CHECKS, FAIL, PASS, SKIP, run_check, run_check_here, runner

NAMED = [
    "flash_attention_fwd",
    "flash_attention_bwd",
    "fused_rmsnorm",
    "fused_swiglu",
    "paged_attention_decode",
    "paged_attention_prefill",
    "cpu_packed_linear",
    "cpu_paged_attention",
    "cpu_fused_ops",
    "engine_greedy_vs_hf",
    "engine_device_vs_cpu",
    "train_one_device",
    "train_layouts",
    "collectives",
    "mfu",
    "paged_attention_bandwidth",
]


def test_quick_selftest_passes_every_check_the_machine_allows(tmp_path, capsys):
    out = tmp_path / "selftest.json"
    t0 = time.monotonic()
    rc = main(["doctor", "--selftest", "--quick", "--json", str(out)])
    elapsed = time.monotonic() - t0
    report = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert list(CHECKS) == NAMED and list(report["checks"]) == NAMED
    assert report["machine"]["cpu_cores"] >= 1 and report["quick"] is True
    for name, r in report["checks"].items():
        assert r["status"] in (PASS, SKIP), (name, r.get("reason"), r.get("traceback"))
        assert r["seconds"] > 0
        assert any(line.startswith(f"{r['status']:<4}  {name} ") for line in text.splitlines()), name
    gpu = torch.cuda.is_available()
    skipped = {n for n, r in report["checks"].items() if r["status"] == SKIP}
    assert skipped == (set() if gpu else {"engine_device_vs_cpu"})
    assert report["checks"]["engine_device_vs_cpu"].get("reason") == (None if gpu else "no CUDA GPU")
    c = report["checks"]
    # measured numbers, not just verdicts
    assert c["flash_attention_fwd"]["errors"]["fp32"]["err"] < 1e-4
    assert c["train_layouts"]["max_rel_loss_diff"] < 1e-4 and len(c["train_layouts"]["layouts"]) >= 7
    assert c["collectives"]["results"]["all_reduce"]["busbw_GBps"] > 0
    assert c["mfu"]["achieved_flops"] > 0 and (c["mfu"]["peak_flops"] is None) == (not gpu)
    assert c["paged_attention_bandwidth"]["bandwidth_GBps"] > 0
    # the CPU fast paths say which path ran: the one this CPU's level chooses
    assert c["cpu_packed_linear"]["paths"] == {
        "fp32": "onednn",
        "bf16": cpu_linear.path(torch.bfloat16),
        "fp16": cpu_linear.path(torch.float16),
        "bf16 small batches": "amx"
        if amx_linear.available()
        else "panels"
        if panel_linear.available(torch.bfloat16)
        else "fp32 panels"
        if cpu_linear.path(torch.bfloat16) == "onednn-fp32" and panel_linear.available()
        else cpu_linear.path(torch.bfloat16),
        "fp32 small batches": "panels" if panel_linear.available() else "onednn",
        "fp32 greedy lm_head": "bf16 screen" if panel_linear.available(torch.bfloat16) else "full product",
    }
    for name in ("cpu_paged_attention", "cpu_fused_ops"):
        assert c[name]["build_isa"] == c[name]["cpu_isa"] == cpu_isa.cpu_isa(), name
        assert f"C++ build {cpu_isa.cpu_isa()};" in c[name]["detail"]
    assert rc == 0 and report["ok"] is True
    assert f"{len(NAMED) - len(skipped)} passed, 0 failed" in text
    assert elapsed < 240  # the budget is 2 minutes on an idle 2-core CPU; CI machines are shared


def test_a_hung_check_is_a_fail_and_leaves_nothing_running():
    before = _children()
    # seven layouts, each with its ranks: 5-7 s from a cold start, 2-3 s from a warm fork server
    r = run_check("train_layouts", quick=True, timeout=1)
    assert r["status"] == FAIL and r["reason"].startswith("hang: no result after 1 s")
    time.sleep(1)
    assert _children() <= before
    assert _group(r["pid"]) == []  # the check and the ranks it started: all gone


def _group(pgid: int) -> list:
    """Live processes of process group ``pgid``."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[2]) == pgid and stat[0] != "Z":
                out.append(int(pid))
    return out


def _children() -> set:
    """Processes whose parent is this one (multiprocessing's fork server and resource tracker
    excluded: they serve every launch of the session)."""
    me, out = os.getpid(), set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                cmd = open(f"/proc/{pid}/cmdline").read()
            except OSError:
                continue
            if (
                int(stat[1]) == me
                and "forkserver" not in cmd
                and "resource_tracker" not in cmd
                and stat[0] != "Z"
            ):
                out.add(int(pid))
    return out


def test_selftest_json_has_the_contract_keys(tmp_path):
    """CONTRACT.md: ``{"checks": {name: {"status", "seconds", ...}}, "machine": {...}}``, exit 1
    only on a FAIL; ``--check`` runs one check."""
    out = tmp_path / "selftest.json"
    assert main(["doctor", "--selftest", "--quick", "--check", "fused_rmsnorm", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["checks"]) == ["fused_rmsnorm"]
    r = report["checks"]["fused_rmsnorm"]
    assert r["status"] in (PASS, SKIP) and isinstance(r["seconds"], float) and r["seconds"] > 0
    assert report["machine"]["cpu_cores"] >= 1 and set(report) == {
        "checks",
        "machine",
        "quick",
        "seconds",
        "ok",
    }


def test_a_broken_cpu_fast_path_fails_its_check_and_the_doctor(monkeypatch, capsys):
    """Each CPU fast-path check compares the kernel with its reference: a kernel 1% off (or a
    packed linear shifted by 0.01) is a FAIL naming what broke, and ``doctor --selftest`` exits 1."""
    for name in ("cpu_packed_linear", "cpu_paged_attention", "cpu_fused_ops"):
        assert run_check_here(name, quick=True)["status"] == PASS, name
    silu_mul, paged = cpu_fused.silu_mul, cpu_paged_attention.paged_attention_cpu
    monkeypatch.setattr(cpu_fused, "silu_mul", lambda g, u: silu_mul(g, u) * 1.01)
    monkeypatch.setattr(cpu_paged_attention, "paged_attention_cpu", lambda *a: paged(*a) * 1.01)
    monkeypatch.setattr(cpu_linear, "linear", lambda x, w, b=None: F.linear(x, w, b) + 0.01)
    broken = {
        name: run_check_here(name, quick=True)
        for name in ("cpu_packed_linear", "cpu_paged_attention", "cpu_fused_ops")
    }
    assert all(r["status"] == FAIL for r in broken.values()), broken
    assert (
        "silu_mul" in broken["cpu_fused_ops"]["reason"]
        and "rms_norm" not in broken["cpu_fused_ops"]["reason"]
    )
    assert "fp32 D64" in broken["cpu_paged_attention"]["reason"]
    assert "fp32 x1" in broken["cpu_packed_linear"]["reason"]
    # the doctor's verdict (its checks run here, in this process, so that they see the broken kernel)
    monkeypatch.setattr(
        runner, "run_check", lambda name, quick, timeout=None: {**run_check_here(name, quick), "seconds": 0.1}
    )
    assert main(["doctor", "--selftest", "--quick", "--check", "cpu_fused_ops"]) == 1
    assert "FAIL  cpu_fused_ops" in capsys.readouterr().out
