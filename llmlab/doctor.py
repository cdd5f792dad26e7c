"""``llmlab doctor``: what this machine offers, whether communication works, how each lab will run.

Checks, each with a verdict and, when it fails, the usual fix:

* versions: Python, torch (CPU or CUDA build), CUDA, NCCL, Triton, transformers;
* hardware: CPU cores, GPUs with their memory, GPU-to-GPU peer access (NVLink/PCIe P2P) and the
  ``nvidia-smi topo -m`` matrix when available;
* communication: a short all-reduce over real gloo ranks (and NCCL over the GPUs), with the measured
  bus bandwidth (nccl-tests' definition: 2(n-1)/n x bytes / time);
* Triton: imports and, on a GPU, compiles and runs a kernel;
* the size every lab will run at here (:func:`llmlab.runtime.hardware.lab_size`).

``llmlab doctor --selftest [--quick] [--json PATH]`` runs :mod:`llmlab.selftest` instead: every
kernel, the engine, training and each parallel layout against its reference, one process per
check, one PASS / FAIL / SKIP line each.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from llmlab.lab_sizes import LAB_SIZES, lab_size_for
from llmlab.runtime.hardware import gpu_count, hardware, lab_size

LABS = list(LAB_SIZES)

FIXES = {
    "gloo": "gloo needs loopback TCP: check that 'localhost' resolves and no firewall blocks "
    "127.0.0.1; on machines with several interfaces set GLOO_SOCKET_IFNAME (e.g. lo or eth0).",
    "nccl": "set NCCL_DEBUG=INFO to see why; NCCL_P2P_DISABLE=1 if GPU peer-to-peer is broken "
    "(some PCIe/VM setups), NCCL_IB_DISABLE=1 without InfiniBand, NCCL_SOCKET_IFNAME to pick "
    "the network interface across nodes.",
    "triton": 'pip install -e ".[kernels]" (llmlab pins triton 3.9.0; the Triton kernels need a '
    "CUDA GPU; on CPU they run only in interpreter mode, TRITON_INTERPRET=1).",
}


def _all_reduce_bandwidth(nbytes: int, iters: int) -> dict:
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.ones(nbytes // 4, device=dev)
    dist.all_reduce(t)  # warm-up, and a correctness check below
    ok = bool(torch.all(t == dist.get_world_size()).item())
    if dev != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    if dev != "cpu":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    n = dist.get_world_size()
    return {
        "ok": ok,
        "time_s": dt,
        "algbw_GBps": nbytes / dt / 1e9,
        "busbw_GBps": 2 * (n - 1) / n * nbytes / dt / 1e9,
    }


def check_comm(backend: str, world_size: int, nbytes: int = 4 << 20, iters: int = 5) -> dict:
    """All-reduce ``nbytes`` over ``world_size`` real ranks; ``{"ok", "busbw_GBps", ...}`` or error."""
    from llmlab.runtime.launch import launch

    try:
        res = launch(_all_reduce_bandwidth, world_size, nbytes, iters, backend=backend, timeout=120)
        r0 = res[0]
        return {
            "backend": backend,
            "ranks": world_size,
            "bytes": nbytes,
            **r0,
            "ok": all(r["ok"] for r in res),
        }
    except Exception as e:  # noqa: BLE001 - the doctor reports, it does not crash
        return {
            "backend": backend,
            "ranks": world_size,
            "ok": False,
            "error": f"{type(e).__name__}: {e}"[:500],
        }


def check_triton() -> dict:
    try:
        import triton
    except ImportError:
        return {"ok": False, "installed": False, "fix": FIXES["triton"]}
    out = {"ok": True, "installed": True, "version": triton.__version__}
    if gpu_count() == 0:
        out["compiles"] = "not checked (no GPU; kernels run on CPU only under TRITON_INTERPRET=1)"
        return out
    try:
        import triton.language as tl

        @triton.jit
        def _add(x, y, o, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = i < n
            tl.store(o + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)

        a = torch.randn(1000, device="cuda")
        o = torch.empty_like(a)
        _add[(4,)](a, a, o, 1000, BLOCK=256)
        out["compiles"] = bool(torch.allclose(o, 2 * a))
        out["ok"] = out["compiles"]
    except Exception as e:  # noqa: BLE001
        out.update(ok=False, compiles=False, error=str(e)[:300], fix=FIXES["triton"])
    return out


def diagnose(comm_ranks: int = 2) -> dict:
    """Run every check; returns a JSON-serialisable report with ``verdict`` ``ok``/``problems``."""
    report: dict[str, Any] = {"hardware": hardware(), "comm": [check_comm("gloo", comm_ranks)]}
    n = gpu_count()
    if n >= 2:
        report["comm"].append(check_comm("nccl", min(n, 8), nbytes=64 << 20))
    report["triton"] = check_triton()
    size = lab_size()
    report["lab_size"] = size.as_dict()
    report["labs"] = {lab: lab_size_for(lab).as_dict() for lab in LABS}
    problems = []
    for c in report["comm"]:
        if not c["ok"]:
            problems.append(
                {
                    "check": f"{c['backend']} all-reduce",
                    "error": c.get("error", "wrong sum"),
                    "fix": FIXES[c["backend"]],
                }
            )
    if n and not report["triton"]["ok"]:
        problems.append(
            {
                "check": "triton",
                "error": report["triton"].get("error", "not installed"),
                "fix": FIXES["triton"],
            }
        )
    report["problems"] = problems
    report["verdict"] = "ok" if not problems else "problems"
    return report


def format_report(r: dict) -> str:
    h = r["hardware"]
    lines = [
        f"llmlab doctor: {'OK' if r['verdict'] == 'ok' else 'PROBLEMS FOUND'}",
        f"  python {h['python']}, torch {h['torch']} ({h['torch_build']}), transformers "
        f"{h['transformers']}, {h['cpu_cores']} CPU cores",
    ]
    if h["gpus"]:
        lines.append(f"  NCCL {h.get('nccl')}")
        for g in h["gpus"]:
            lines.append(
                f"  GPU {g['index']}: {g['name']}, {g['memory_bytes'] / 2**30:.1f} GiB, "
                f"peer access to {g['peer_access'] or 'none'}"
            )
    else:
        lines.append("  no CUDA GPU: labs run on CPU ranks with gloo")
    for c in r["comm"]:
        if c["ok"]:
            lines.append(
                f"  {c['backend']} all-reduce over {c['ranks']} ranks: ok, "
                f"{c['bytes'] / 2**20:.0f} MiB in {c['time_s'] * 1e3:.1f} ms, bus bandwidth "
                f"{c['busbw_GBps']:.2f} GB/s"
            )
        else:
            lines.append(f"  {c['backend']} all-reduce over {c['ranks']} ranks: FAILED: {c.get('error')}")
    t = r["triton"]
    lines.append(
        f"  triton: {t.get('version', 'not installed')}"
        + (f", compiles: {t['compiles']}" if "compiles" in t else "")
    )
    lines.append(f"  {lab_size_line(r)}")
    for lab, s in r["labs"].items():
        if s["world_size"] == 1:
            lines.append(f"    {lab:<24} 1 process on {s['device']}, model '{s['model']}'")
        else:
            lines.append(
                f"    {lab:<24} {s['world_size']} ranks ({s['backend']}, {s['device']}), "
                f"model '{s['model']}', {s['steps']} steps"
            )
    if "version" not in t:
        lines.append(
            "  note: triton is not installed, so lab 09 skips its Triton kernels (and the engine "
            'uses PyTorch attention): pip install -e ".[kernels]"'
        )
    for p in r["problems"]:
        lines.append(f"  problem: {p['check']}: {p['error']}\n    fix: {p['fix']}")
    return "\n".join(lines)


def lab_size_line(r: dict) -> str:
    s = r["lab_size"]
    where = f"{s['num_gpus']} GPU(s)" if s["device"] == "cuda" else f"CPU, {s['cpu_cores']} cores"
    return f"labs will run as ({s['kind']}: {where}):"


def add_arguments(p) -> None:
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks for the gloo check (default 2)")
    p.add_argument(
        "--selftest",
        action="store_true",
        help="run every correctness check and measurement this machine allows, each in "
        "its own process with a timeout (llmlab.selftest); exit code 1 on a FAIL",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="with --selftest: smaller sizes (about 2 minutes on a 2-core CPU)",
    )
    p.add_argument(
        "--check",
        action="append",
        default=None,
        metavar="NAME",
        help="with --selftest: run only this check (repeatable)",
    )
    p.add_argument(
        "--nodes",
        action="store_true",
        help="under torchrun on every host: the cluster's pre-flight table (inventory, "
        "rendezvous, all-reduce inside and between nodes, checkpoint dir, interface "
        "variables); exit code 1 on a FAIL (llmlab.tools.node_check)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="with --nodes: check that every node can write and read this directory",
    )
    p.add_argument(
        "--bytes", type=int, default=4 << 20, help="with --nodes: all-reduce size for the bandwidth lines"
    )
    p.add_argument(
        "--min-bandwidth",
        type=float,
        default=0.0,
        metavar="GBPS",
        help="with --nodes: FAIL a link whose all-reduce bus bandwidth is below this (GB/s)",
    )


def run(args) -> int:
    if args.nodes:
        from llmlab.tools.node_check import run as run_nodes

        return run_nodes(args)
    if args.selftest or args.quick or args.check:
        from llmlab.selftest import run_selftest

        report = run_selftest(quick=args.quick, json_path=args.json, only=args.check)
        return 0 if report["ok"] else 1
    if args.ranks < 2:
        raise ValueError(f"--ranks must be >= 2 for the all-reduce check, got {args.ranks}")
    r = diagnose(comm_ranks=args.ranks)
    print(format_report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if r["verdict"] == "ok" else 1


if __name__ == "__main__":  # pragma: no cover
    import argparse

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
