"""The self-test runner: :data:`CHECKS`, one process per check with its timeout, the report and
the ``python -m llmlab.selftest NAME [--quick]`` entry (see :mod:`llmlab.selftest`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from typing import Callable

from llmlab.runtime import process
from llmlab.runtime.hardware import hardware
from llmlab.selftest.common import FAIL, PASS, SKIP, Skip, _gpu
from llmlab.selftest.cpu_kernels import (
    check_cpu_fused_ops,
    check_cpu_packed_linear,
    check_cpu_paged_attention,
)
from llmlab.selftest.engine import check_engine_device_vs_cpu, check_engine_greedy_vs_hf
from llmlab.selftest.kernels import (
    check_flash_attention_bwd,
    check_flash_attention_fwd,
    check_fused_rmsnorm,
    check_fused_swiglu,
    check_paged_attention_bandwidth,
    check_paged_attention_decode,
    check_paged_attention_prefill,
)
from llmlab.selftest.training import check_collectives, check_mfu, check_train_layouts, check_train_one_device


# --------------------------------------------------------------------------------------------
# Runner: one process per check
# --------------------------------------------------------------------------------------------
# name -> (check, timeout full s, timeout quick s)
CHECKS: dict[str, tuple[Callable[[bool], dict], float, float]] = {
    "flash_attention_fwd": (check_flash_attention_fwd, 180, 60),
    "flash_attention_bwd": (check_flash_attention_bwd, 240, 60),
    "fused_rmsnorm": (check_fused_rmsnorm, 120, 45),
    "fused_swiglu": (check_fused_swiglu, 120, 45),
    "paged_attention_decode": (check_paged_attention_decode, 180, 60),
    "paged_attention_prefill": (check_paged_attention_prefill, 180, 60),
    "cpu_packed_linear": (check_cpu_packed_linear, 120, 60),
    "cpu_paged_attention": (check_cpu_paged_attention, 300, 240),  # (a first use builds it)
    "cpu_fused_ops": (check_cpu_fused_ops, 300, 240),
    "engine_greedy_vs_hf": (check_engine_greedy_vs_hf, 180, 60),
    "engine_device_vs_cpu": (check_engine_device_vs_cpu, 300, 120),
    "train_one_device": (check_train_one_device, 240, 60),
    "train_layouts": (check_train_layouts, 480, 150),
    "collectives": (check_collectives, 180, 60),
    "mfu": (check_mfu, 180, 60),
    "paged_attention_bandwidth": (check_paged_attention_bandwidth, 120, 45),
}


def run_check_here(name: str, quick: bool) -> dict:
    """Run one check in this process: its result dict (``status`` PASS/FAIL/SKIP, ...)."""
    fn = CHECKS[name][0]
    try:
        return fn(quick)
    except Skip as e:
        return {"status": SKIP, "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - a check's error is its verdict
        import traceback

        return {
            "status": FAIL,
            "reason": f"{type(e).__name__}: {e}"[:1000],
            "traceback": traceback.format_exc()[-3000:],
        }


def _child_entry(name: str, quick: bool, path: str, env: dict) -> None:
    os.setsid()  # its own process group: a timeout kills the check and every rank it started
    process.die_with_parent()  # and it dies with the fork server, which dies with the doctor
    log = os.open(path + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # progress bars and warnings go to the check's log, not between the lines
    os.dup2(log, 2)
    triton = sys.modules.get("triton")  # (Triton reads TRITON_INTERPRET when asked, but its
    built_for_gpu = triton is not None and not triton.knobs.runtime.interpret  # builtins at import)
    os.environ.update(env)  # TRITON_INTERPRET must be set before triton is first imported
    if built_for_gpu and not _gpu():
        # the fork server imported triton before TRITON_INTERPRET was set: a fresh interpreter
        os.execv(
            sys.executable,
            [sys.executable, "-m", "llmlab.selftest", name, "--result", path]
            + (["--quick"] if quick else []),
        )
    res = run_check_here(name, quick)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, default=str)
    os.replace(path + ".tmp", path)


def run_check(name: str, quick: bool, timeout: float | None = None) -> dict:
    """Run one check in its own process (forked from the launcher's fork server, which has torch
    imported already) and kill its process group at ``timeout`` s (then: FAIL, "hang"). Returns
    the check's result with ``seconds`` added."""
    timeout = timeout or (CHECKS[name][2] if quick else CHECKS[name][1])
    env = dict(os.environ)
    if not _gpu():
        env.setdefault("TRITON_INTERPRET", "1")
    fd, path = tempfile.mkstemp(prefix="llmlab-selftest-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    t0 = time.perf_counter()
    proc = None
    try:
        proc = process.start(_child_entry, (name, quick, path, env), name=f"llmlab-selftest-{name}")
        proc.join(timeout)
        seconds = time.perf_counter() - t0
        if proc.exitcode is None:
            return {
                "status": FAIL,
                "seconds": seconds,
                "log_tail": _tail(path + ".log"),
                "pid": proc.pid,
                "reason": f"hang: no result after {timeout:.0f} s (process group killed)",
            }
        if not os.path.exists(path):
            return {
                "status": FAIL,
                "seconds": seconds,
                "log_tail": _tail(path + ".log"),
                "reason": f"the check process died (exit code {proc.exitcode}) without a result",
            }
        with open(path) as f:
            res = json.load(f)
        res["seconds"] = seconds
        return res
    finally:
        if proc is not None:
            process.kill_group(proc)
        for p in (path, path + ".log"):
            if os.path.exists(p):
                os.unlink(p)


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-n:])
    except OSError:
        return ""


def format_line(name: str, r: dict) -> str:
    what = r.get("detail", "") if r["status"] == PASS else r.get("reason", "")
    if r["status"] == PASS and r.get("note"):
        what += f" ({r['note']})"
    return f"{r['status']:<4}  {name:<26} {r.get('seconds', 0):6.1f}s  {what}"


def run_selftest(
    quick: bool = False,
    json_path: str | None = None,
    only: list[str] | None = None,
    echo: Callable[[str], None] = print,
) -> dict:
    """Run the checks (``only``: a subset, by name) one process each; echo one line per check.
    Returns ``{"checks", "machine", "quick", "seconds", "ok"}`` (``machine``: this machine's
    inventory, :func:`llmlab.runtime.hardware.hardware`) and writes it to ``json_path``.
    Raises ``ValueError`` for an unknown check name."""
    names = list(only) if only else list(CHECKS)
    for n in names:
        if n not in CHECKS:
            raise ValueError(f"no self-test check named {n!r}; checks: {', '.join(CHECKS)}")
    hw = hardware()
    kernels = (
        "kernels in Triton's interpreter"
        if importlib.util.find_spec("triton")
        else "no Triton: kernel checks skipped"
    )
    where = (
        f"{len(hw['gpus'])} x {hw['gpus'][0]['name']}"
        if hw["gpus"]
        else f"CPU only, {hw['cpu_cores']} cores ({kernels})"
    )
    echo(f"llmlab self-test{' (quick)' if quick else ''}: {where}, torch {hw['torch']}")
    if not hw["gpus"]:  # the kernels run in Triton's interpreter, chosen before triton's import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.perf_counter()
    checks = {}
    for n in names:
        checks[n] = run_check(n, quick)
        echo(format_line(n, checks[n]))
    total = time.perf_counter() - t0
    failed = [n for n, r in checks.items() if r["status"] == FAIL]
    counts = {s: sum(r["status"] == s for r in checks.values()) for s in (PASS, FAIL, SKIP)}
    echo(
        f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped in {total:.0f} s"
        + (f"; failed: {', '.join(failed)} (see docs/workshop.md, 'Self-test')" if failed else "")
    )
    report = {"checks": checks, "machine": hw, "quick": quick, "seconds": total, "ok": not failed}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def _main(argv: list[str]) -> int:
    """``python -m llmlab.selftest NAME [--quick]``: one check in this process (for debugging)."""
    name, quick = argv[0], "--quick" in argv[1:]
    if not _gpu():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    res = run_check_here(name, quick)
    if "--result" in argv:  # re-executed by _child_entry: the result goes to its file
        path = argv[argv.index("--result") + 1]
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, default=str)
        os.replace(path + ".tmp", path)
        return 0
    print(format_line(name, res))
    if res["status"] == FAIL and res.get("traceback"):
        print(res["traceback"])
    return 1 if res["status"] == FAIL else 0
