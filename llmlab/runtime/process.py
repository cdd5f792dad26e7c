"""Starting processes: the one place llmlab starts one, and the one place it picks a backend.

Every process llmlab starts (the ranks of :func:`llmlab.runtime.launch.launch`, the workers of
tensor-parallel inference, each self-test check) is started here, the same way:

* **spawn**: forked from a *forkserver* that has imported only ``torch`` (after its first start,
  ~2 s on a 2-core CPU box, 4 ranks start in ~0.1 s; no learner-editable module is cached in it),
  with the caller's ``__main__`` hidden, so an unguarded script or a notebook kernel is never
  re-run in the child (:func:`start`); what a child needs travels by value (``cloudpickle`` bytes);
* **die with the parent**: a child calls :func:`die_with_parent` first (``PR_SET_PDEATHSIG``: it is
  killed when the fork server, which dies with the caller, goes away), and :func:`stop` ends the
  ones still running (terminate, then kill);
* **rendezvous**: a ``TCPStore`` the caller hosts on a socket it has already bound to 127.0.0.1 on
  an OS-chosen port (:func:`loopback_store`): no port is found free and bound later, which another
  process could take in between; children join it (:func:`join_store`) and build the process
  group on it (:func:`init_process_group`), which times out after ``LLMLAB_PG_TIMEOUT`` seconds
  (default 300; :func:`pg_timeout`);
* **backend**: :func:`resolve_backend` (gloo on CPU, NCCL with one GPU per rank);
* **the child's first lines**: :func:`setup_child` (die with the parent, the caller's current
  environment, threads from the seat's usable cores by :func:`child_threads`, its GPU under NCCL);
  a rank ``torchrun`` started instead joins its job with :func:`join_torchrun`.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

from llmlab.runtime.hardware import usable_cores
from typing import Any, Callable, Iterator


def pg_timeout() -> datetime.timedelta:
    """How long a collective or the rendezvous waits: ``LLMLAB_PG_TIMEOUT`` seconds (default 300)."""
    return datetime.timedelta(seconds=float(os.environ.get("LLMLAB_PG_TIMEOUT", "300")))


def resolve_backend(
    backend: str = "auto",
    ranks: int | None = 1,
    *,
    device: str | None = None,
    what: str = "world_size",
    where: str = "",
) -> str:
    """The ``torch.distributed`` backend for ``ranks`` ranks on this node.

    ``auto``: with ``device`` given, NCCL for a CUDA device and gloo otherwise; without it, NCCL
    when this node has at least ``ranks`` GPUs, else gloo. ``ranks=None``: the count is not known
    here (the launcher that starts the ranks checks it). ``what``/``where`` name the count in the
    error (e.g. ``LOCAL_WORLD_SIZE``, `` on this node``). Raises ``ValueError`` for an unknown
    backend, or NCCL with more ranks than GPUs (NCCL cannot put two ranks on one GPU).
    """
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        if device is None:
            return "nccl" if n >= (ranks or 1) and n > 0 else "gloo"
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: expected 'auto', 'gloo' or 'nccl'")
    if backend == "nccl" and ranks is not None and ranks > n:
        per = "local rank" if what != "world_size" else "rank"
        raise ValueError(f"backend='nccl' needs one GPU per {per}: {what}={ranks} > {n} GPUs{where}")
    return backend


def under_torchrun() -> bool:
    """True when this process is a rank started by ``torchrun`` (or another env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def resolve_torchrun_backend(backend: str) -> str:
    """The backend of a ``torchrun`` rank: ``auto`` -> NCCL only when this node has one GPU per
    local rank (``LOCAL_WORLD_SIZE`` <= visible GPUs), else gloo; NCCL cannot put two ranks on
    one GPU. Raises ``ValueError`` for an unknown backend, or ``nccl`` with fewer GPUs than local
    ranks (naming both counts)."""
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return resolve_backend(backend, local_ws, what="LOCAL_WORLD_SIZE", where=" on this node")


def child_threads(ranks: int, backend: str) -> int:
    """Threads of each of ``ranks`` CPU (gloo) ranks started on this node: the seat's usable
    cores (:func:`~llmlab.runtime.hardware.usable_cores`, its affinity set, not the node's core
    count) shared out, at least 1; a GPU (NCCL) rank needs 1."""
    return max(1, usable_cores() // ranks) if backend == "gloo" else 1


def bind_device(backend: str, local_rank: int) -> None:
    """Under NCCL, make GPU ``local_rank`` (mod the visible count) this process's device."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def setup_child(env: dict[str, str], threads: int, backend: str, local_rank: int) -> None:
    """What every process llmlab starts runs first (before joining the rendezvous store): die
    with the parent (:func:`die_with_parent`), take the caller's *current* environment (the fork
    server's dates from its start), ``threads`` intra-op threads (:func:`child_threads`), and,
    under NCCL, its GPU (:func:`bind_device`)."""
    die_with_parent()
    os.environ.update(env)
    torch.set_num_threads(threads)
    bind_device(backend, local_rank)


def join_torchrun(backend: str = "auto") -> tuple[str, bool]:
    """A rank ``torchrun`` started joins its job: the backend (:func:`resolve_torchrun_backend`),
    its GPU under NCCL (``LOCAL_RANK``), and the default process group from the environment
    (``env://``, timing out after :func:`pg_timeout`) unless one is initialised already.
    Returns ``(backend, whether this call created the group)``: its creator destroys it."""
    backend = resolve_torchrun_backend(backend)
    bind_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return backend, False
    from llmlab.runtime.elastic import check_torchrun_environment

    check_torchrun_environment(backend)  # interface variables, restarts: refused before joining
    dist.init_process_group(backend, init_method="env://", timeout=pg_timeout())
    return backend, True


_ctx: Any = None


def context() -> Any:
    """The multiprocessing context every llmlab process is started from (forkserver, else spawn)."""
    global _ctx
    if _ctx is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        _ctx = mp.get_context(method)
        if method == "forkserver":
            _ctx.set_forkserver_preload(
                ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "cloudpickle"]
            )
            # OpenMP threads that spin while idle starve other ranks (and other jobs) on a few
            # cores; the fork server reads this when it loads torch, and its ranks inherit it.
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return _ctx


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Stop multiprocessing from re-running the caller's ``__main__`` script in each child.

    What a child runs travels by value, so it never needs the caller's main module; re-importing it
    would re-run an unguarded script (and cannot work for a notebook kernel at all).
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
    try:
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def start(target: Callable[..., None], args: tuple[Any, ...], name: str) -> Any:
    """Start ``target(*args)`` in a new process (see the module docstring) and return it
    (a ``multiprocessing.Process``). ``target`` should call :func:`die_with_parent` first."""
    p = context().Process(target=target, args=args, name=name, daemon=False)
    with main_module_hidden():
        p.start()
    return p


def die_with_parent() -> None:
    """Ask the kernel to kill this process when its parent dies (Linux; a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        pass


def stop(procs: list[Any], grace: float = 3.0) -> None:
    """End the processes still running: terminate, wait up to ``grace`` s in all, then kill."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2)


def kill_group(proc: Any) -> None:
    """Kill the process group led by ``proc`` (a child that called ``os.setsid()``) and reap it."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.join(5)


def loopback_store(host: str = "127.0.0.1") -> dist.TCPStore:
    """The rendezvous store, hosted by this process on 127.0.0.1 only (given a socket bound before
    the store exists: TCPStore's own listener binds every interface whatever host it is given).
    Falls back to TCPStore's listener where this torch cannot take a socket. Its port: ``.port``.
    ``host``: another address of this machine to listen on instead (ranks on other nodes: the
    Ray executor passes the address its nodes reach this one by)."""
    timeout = pg_timeout()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns (and closes) the descriptor from now on
    except OSError:
        sock.close()
        fd = None
    if fd is not None:
        try:
            return dist.TCPStore(
                host,
                port,
                world_size=None,
                is_master=True,
                wait_for_workers=False,
                timeout=timeout,
                master_listen_fd=fd,
            )
        except (RuntimeError, TypeError, ValueError):
            with contextlib.suppress(OSError):
                os.close(fd)
    return dist.TCPStore(
        "127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False, timeout=timeout
    )


def join_store(host: str, port: int) -> dist.TCPStore:
    """A child's client of the caller's :func:`loopback_store`."""
    return dist.TCPStore(host, port, is_master=False, timeout=pg_timeout())


def init_process_group(backend: str, store: Any, rank: int, world_size: int) -> None:
    """The default process group, rendezvousing on ``store`` (under the ``pg`` prefix, so the
    store's other keys stay the caller's), timing out after :func:`pg_timeout`."""
    dist.init_process_group(
        backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size, timeout=pg_timeout()
    )


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), or None."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def local_env(backend: str) -> dict[str, str]:
    """The caller's environment for local children: with gloo, its sockets on the loopback
    interface (all ranks are on this machine, not on the network) unless the user chose one."""
    env = dict(os.environ)
    lo = loopback_interface()
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in env and lo:
        env["GLOO_SOCKET_IFNAME"] = lo
    return env
