"""``llmlab doctor --nodes``: the pre-flight check of a cluster, run under torchrun on every host.

The source articles' step 4 (a multi-node communication check before anything runs), as one table:

* **inventory** of every node: host name, ranks, CPU cores, GPUs, torch, the interface address;
* **rendezvous**: every rank reached the job's store (``MASTER_ADDR:MASTER_PORT``), and how long
  it took;
* **interface variables** on each node (:func:`llmlab.runtime.elastic.check_interface_variables`:
  a ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` naming no interface, loopback across nodes) and
  their **consistency** (the same value on every node);
* **all-reduce** bandwidth (bus bandwidth, nccl-tests' ``2(n-1)/n x bytes / time``) and latency
  (a 1-element all-reduce) inside each node and between every pair of nodes (their local rank 0s);
* **checkpoint directory**: every node writes a file into it and every node must read every file
  (a directory each node has its own copy of fails, naming the nodes).

Each line is PASS or FAIL, a FAIL with its fix; the exit code is 1 on any FAIL. When a node fails
a local check (an interface that cannot work), no rank builds the process group: the table is
printed from what the ranks posted in the rendezvous store, and every rank exits at once (no
rank waits for a collective that cannot happen). Only JSON and tensors cross the network.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import socket
import statistics
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from llmlab.runtime.elastic import check_interface_variables, ipv4_interfaces
from llmlab.runtime.hardware import gpu_count, usable_cores
from llmlab.runtime.launch import under_torchrun
from llmlab.runtime.process import pg_timeout, resolve_torchrun_backend

VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
PREFIX = "llmlab-doctor/"


def _row(check: str, where: str, ok: bool, detail: str, fix: str = "") -> dict:
    return {
        "check": check,
        "where": where,
        "result": "PASS" if ok else "FAIL",
        "detail": detail,
        "fix": "" if ok else fix,
    }


def local_report(backend: str) -> dict:
    """What this rank knows before any collective: its node, inventory and interface check."""
    ifaces = ipv4_interfaces()
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    try:
        check_interface_variables(backend=backend, ifaces=ifaces)
        problem = None
    except ValueError as e:
        problem = str(e)
    return {
        "rank": int(os.environ["RANK"]),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "host": socket.gethostname(),
        "cpu_cores": usable_cores(),
        "gpus": gpu_count(),
        "torch": torch.__version__,
        "address": ifaces.get(name) if name else None,
        "interface": name or None,
        "vars": {v: os.environ.get(v) for v in VARS},
        "problem": problem,
    }


def _post_and_collect(store, key: str, value: dict, world: int) -> list[dict]:
    """Every rank posts ``value`` under ``key/<rank>`` and reads everyone's (JSON, no pickle)."""
    store.set(f"{PREFIX}{key}/{value['rank']}", json.dumps(value))
    return [json.loads(store.get(f"{PREFIX}{key}/{r}")) for r in range(world)]


def _timed_all_reduce(t: torch.Tensor, group, iters: int) -> float:
    dist.all_reduce(t, group=group)  # warm-up (and the connection)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        if t.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(group, n: int, nbytes: int, device: torch.device) -> dict:
    """Bus bandwidth (GB/s) of an ``nbytes`` all-reduce and latency (ms) of a 1-element one."""
    big = torch.ones(max(1, nbytes // 4), device=device)
    dt = _timed_all_reduce(big, group, 3)
    lat = _timed_all_reduce(torch.ones(1, device=device), group, 10)
    return {"busbw_GBps": 2 * (n - 1) / n * nbytes / dt / 1e9, "time_s": dt, "latency_ms": lat * 1e3}


def _links(reports: list[dict]) -> list[tuple[str, str, list[int]]]:
    """(check, where, ranks) of every all-reduce to measure: inside each node, each pair of nodes."""
    nodes = sorted({r["node"] for r in reports})
    ranks = {k: [r["rank"] for r in reports if r["node"] == k] for k in nodes}
    leaders = {k: min(v) for k, v in ranks.items()}
    out = [("all-reduce inside node", f"node{k}", v) for k, v in ranks.items() if len(v) > 1]
    out += [
        ("all-reduce between nodes", f"node{a}-node{b}", [leaders[a], leaders[b]])
        for a, b in itertools.combinations(nodes, 2)
    ]
    return out


def _link_rows(reports, store, nbytes, min_bw, device) -> list[dict]:
    rank, rows = dist.get_rank(), []
    for i, (check, where, members) in enumerate(_links(reports)):
        group = dist.new_group(members, timeout=pg_timeout())  # collective over the world
        if rank in members:
            m = measure(group, len(members), nbytes, device)
            if rank == members[0]:
                store.set(f"{PREFIX}link/{i}", json.dumps(m))
        dist.barrier()
        m = json.loads(store.get(f"{PREFIX}link/{i}"))
        ok = m["busbw_GBps"] >= min_bw
        rows.append(
            {"busbw_GBps": m["busbw_GBps"], "latency_ms": m["latency_ms"]}
            | _row(
                check,
                where,
                ok,
                f"{len(members)} ranks: bus bandwidth "
                f"{m['busbw_GBps']:.3f} GB/s ({nbytes / 2**20:.0f} MiB), latency "
                f"{m['latency_ms']:.2f} ms",
                f"below --min-bandwidth {min_bw} GB/s: check the link (its rate, MTU, the "
                f"interface in GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME)",
            )
        )
    return rows


def _checkpoint_row(directory: str, reports: list[dict], store, token: str) -> dict:
    """Each node's local rank 0 writes a file; every one of them must read every node's."""
    me = reports[dist.get_rank()]
    leader = me["local_rank"] == 0
    nodes = sorted({r["node"] for r in reports})
    path = Path(directory) / f".llmlab-doctor-{token}-node{me['node']}"
    err = None
    if leader:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            path.write_text(token)
        except OSError as e:
            err = f"node{me['node']} cannot write there: {e.strerror}"
    dist.barrier()
    if leader and err is None:
        blind = [k for k in nodes if not _reads(Path(directory) / f".llmlab-doctor-{token}-node{k}", token)]
        if blind:
            err = f"node{me['node']} does not see the files of node(s) {blind}"
    seen = _post_and_collect(store, "ckpt", {"rank": dist.get_rank(), "err": err}, dist.get_world_size())
    dist.barrier()
    if leader:
        with contextlib.suppress(OSError):  # not there when it could not be written
            path.unlink(missing_ok=True)
    errors = [s["err"] for s in seen if s["err"]]
    return _row(
        "checkpoint dir",
        "all nodes",
        not errors,
        f"{directory}: " + ("; ".join(errors) if errors else f"written and read by all {len(nodes)} nodes"),
        "use a directory on a filesystem every node mounts (NFS, Lustre, a cloud share), "
        "writable by the user running the job",
    )


def _reads(path: Path, token: str) -> bool:
    try:
        return path.read_text() == token
    except OSError:
        return False


def _static_rows(reports: list[dict]) -> list[dict]:
    """Inventory, rendezvous and interface rows from what every rank posted."""
    rows = []
    for k in sorted({r["node"] for r in reports}):
        mine = [r for r in reports if r["node"] == k]
        r0 = mine[0]
        rows.append(
            _row(
                "inventory",
                f"node{k}",
                True,
                f"{r0['host']}: {len(mine)} ranks, {r0['cpu_cores']} CPU cores, {r0['gpus']} GPUs, "
                f"torch {r0['torch']}, {r0['interface'] or 'default interface'} "
                f"{r0['address'] or ''}".rstrip(),
            )
        )
        problems = sorted({r["problem"] for r in mine if r["problem"]})
        rows.append(
            _row(
                "interface",
                f"node{k}",
                not problems,
                problems[0] if problems else "the interface variables name usable interfaces here",
                "set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME with NCCL) on this node to its interface "
                "between nodes, one of those listed",
            )
        )
        rows.append(
            _row(
                "rendezvous",
                f"node{k}",
                True,
                f"{len(mine)} ranks reached the job's store {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} (slowest in {max(r['join_s'] for r in mine):.2f} s)",
            )
        )
    for v in VARS:
        values = {r["node"]: r["vars"][v] for r in reports}
        same = len(set(values.values())) == 1
        shown = next(iter(values.values())) if same else ", ".join(f"node{k}={x}" for k, x in values.items())
        rows.append(
            _row(
                "same variable",
                "all nodes",
                same,
                f"{v}={shown}",
                f"export the same {v} on every node before torchrun",
            )
        )
    return rows


def format_table(rows: list[dict], header: str) -> str:
    """One line per check: check, where, PASS/FAIL, detail; a FAIL's fix on the next line."""
    w1 = max(len(r["check"]) for r in rows)
    w2 = max(len(r["where"]) for r in rows)
    lines = [header, f"{'check':<{w1}}  {'where':<{w2}}  result  detail"]
    for r in rows:
        lines.append(f"{r['check']:<{w1}}  {r['where']:<{w2}}  {r['result']:<6}  {r['detail']}")
        if r["fix"]:
            lines.append(f"{'':<{w1}}  {'':<{w2}}  {'':<6}  fix: {r['fix']}")
    failed = sum(r["result"] == "FAIL" for r in rows)
    lines.append(f"{len(rows) - failed} PASS, {failed} FAIL")
    return "\n".join(lines)


def check_nodes(
    checkpoint_dir: str | None = None, nbytes: int = 4 << 20, min_bandwidth: float = 0.0
) -> list[dict]:
    """Every rank of a torchrun job: run the checks, return the table's rows (the same on every
    rank). Raises ``ValueError`` outside torchrun."""
    if not under_torchrun():
        raise ValueError(
            "--nodes runs under torchrun on every host: torchrun --nnodes N "
            "--nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HEAD:PORT "
            "-m llmlab doctor --nodes"
        )
    backend = resolve_torchrun_backend("auto")
    t0 = time.perf_counter()
    store, rank, world = next(dist.rendezvous("env://", timeout=pg_timeout()))
    join_s = time.perf_counter() - t0
    reports = _post_and_collect(store, "report", local_report(backend) | {"join_s": join_s}, world)
    if any(r["problem"] for r in reports):  # no collective that cannot work is tried
        _finish(store, rank, world)
        return _static_rows(reports)
    dist.init_process_group(
        backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world, timeout=pg_timeout()
    )
    try:
        device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            if backend == "nccl"
            else torch.device("cpu")
        )
        rows = _static_rows(reports) + _link_rows(reports, store, nbytes, min_bandwidth, device)
        if checkpoint_dir:
            token = json.loads(store.get(PREFIX + "token")) if rank else uuid.uuid4().hex[:12]
            if rank == 0:
                store.set(PREFIX + "token", json.dumps(token))
            rows.append(_checkpoint_row(checkpoint_dir, reports, store, token))
        dist.barrier()
        return rows
    finally:
        dist.destroy_process_group()
        _finish(store, rank, world)


def _finish(store, rank: int, world: int) -> None:
    """Rank 0 hosts the store: it leaves only once every rank has read what it needs."""
    store.add(PREFIX + "done", 1)
    deadline = time.monotonic() + pg_timeout().total_seconds()
    while rank == 0 and store.add(PREFIX + "done", 0) < world and time.monotonic() < deadline:
        time.sleep(0.02)


def run(args: argparse.Namespace) -> int:
    """``llmlab doctor --nodes``: the table on rank 0 (and ``--json``); 1 on any FAIL."""
    rows = check_nodes(args.checkpoint_dir, args.bytes, args.min_bandwidth)
    if os.environ.get("RANK", "0") == "0":
        nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        print(
            format_table(rows, f"llmlab doctor --nodes: {nodes} nodes, {os.environ['WORLD_SIZE']} ranks"),
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0
