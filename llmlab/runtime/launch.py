"""Run a function on N real processes: from a script, a notebook cell, or under ``torchrun``.

``launch(fn, world_size, *args)`` starts ``world_size`` processes, initialises a
``torch.distributed`` process group in each (gloo on CPU, NCCL with one GPU per rank on CUDA),
calls ``fn(*args, **kwargs)`` on every rank and returns the list of per-rank return values.

How (measured on a 2-core CPU box):

* ranks are forked from a *forkserver* that has imported only ``torch``: after the server's first
  start (~2 s), 4 ranks start in ~0.1 s, and no learner-editable module is cached in it;
* ``fn`` and its arguments travel by value with ``cloudpickle``, so a function defined in a
  notebook cell works (it must not capture unpicklable objects such as open files or locks);
* rendezvous goes through a ``TCPStore`` the caller hosts on an OS-chosen port (never a fixed
  port), which also carries results, errors and live metrics (:func:`report`);
* each rank writes its stdout/stderr to ``<log_dir>/rank<r>.log`` (rank prints would vanish or
  land in a random notebook cell), dies with its parent (``PR_SET_PDEATHSIG``), and if a rank
  raises, the others are killed and :class:`RankError` carries its rank and traceback.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` already set, one or several nodes),
``launch`` joins that rank's process group with ``env://``, runs ``fn`` once and returns every
rank's result (gathered with ``all_gather_object``).
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import cloudpickle
import torch
import torch.distributed as dist
import multiprocessing as mp

_PG_TIMEOUT_S = float(os.environ.get("LLMLAB_PG_TIMEOUT", "300"))


class RankError(RuntimeError):
    """A rank failed. ``rank`` is its global rank, ``rank_traceback`` the traceback text,
    ``log_dir`` the folder holding every rank's ``rank<r>.log`` (kept after a failure for reading;
    the caller may remove it)."""

    def __init__(self, rank: int, message: str, rank_traceback: str = "", log_dir: str | None = None):
        self.rank, self.rank_traceback, self.log_dir = rank, rank_traceback, log_dir
        super().__init__(f"rank {rank} failed: {message}\n{rank_traceback}".rstrip())


# --------------------------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------------------------
_channel: dict[str, Any] = {}


def report(record: dict) -> None:
    """Send a JSON-serialisable record from this rank to the caller's ``on_metric`` callback.

    A no-op outside :func:`launch` (e.g. a single process or under torchrun without a callback).
    """
    store, rank = _channel.get("store"), _channel.get("rank")
    if store is None:
        cb = _channel.get("local_callback")
        if cb is not None:
            cb(_channel.get("rank", 0), record)
        return
    i = _channel["n"] = _channel.get("n", 0) + 1
    store.set(f"m/{rank}/{i}", json.dumps(record))
    store.add(f"n/{rank}", 1)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        pass


def _entry(rank, world_size, backend, host, port, payload, log_dir, threads, env):
    _die_with_parent()
    # The fork server's environment dates from its start; apply the caller's current one.
    os.environ.update(env)
    log = open(Path(log_dir) / f"rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    store = None
    try:
        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=datetime.timedelta(seconds=_PG_TIMEOUT_S))
        _channel.update(store=store, rank=rank)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=_PG_TIMEOUT_S))
        fn, args, kwargs = cloudpickle.loads(payload)
        result = fn(*args, **kwargs)
        store.set(f"res/{rank}", cloudpickle.dumps(result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything must reach the caller
        tb = traceback.format_exc()
        print(tb, flush=True)
        if store is not None:
            try:
                store.set(f"err/{rank}", tb)
            except Exception:  # noqa: BLE001
                pass
        log.flush()
        os._exit(1)
    log.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# The caller
# --------------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    """True when this process is a rank started by ``torchrun`` (or another env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def resolve_backend(backend: str, world_size: int) -> str:
    """``auto`` -> NCCL when CUDA has at least ``world_size`` GPUs on this node, else gloo.

    Raises ``ValueError`` for an unknown backend, or NCCL with more ranks than GPUs.
    """
    if backend == "auto":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "nccl" if n >= world_size and n > 0 else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: expected 'auto', 'gloo' or 'nccl'")
    if backend == "nccl":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > n:
            raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} "
                             f"> {n} GPUs")
    return backend


_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        _ctx = mp.get_context(method)
        if method == "forkserver":
            _ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.optim", "torch._dynamo",
                                         "cloudpickle"])
            # OpenMP threads that spin while idle starve other ranks (and other jobs) on a few
            # cores; the fork server reads this when it loads torch, and its ranks inherit it.
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return _ctx


def launch(fn: Callable, world_size: int, *args, backend: str = "auto",
           timeout: float | None = None, log_dir: str | os.PathLike | None = None,
           on_metric: Callable[[int, dict], None] | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results, by rank.

    Args:
        fn: any picklable-by-cloudpickle callable; inside it ``torch.distributed`` is
            initialised (``dist.get_rank()``, ``dist.get_world_size()``).
        world_size: number of processes (ranks), >= 1.
        backend: ``"auto"`` (NCCL if there are >= world_size GPUs, else gloo), ``"gloo"``,
            ``"nccl"``.
        timeout: seconds before the whole run is killed (``None``: no limit; collectives
            still time out after ``LLMLAB_PG_TIMEOUT`` seconds, default 300).
        log_dir: where ``rank<r>.log`` files go (default: a fresh temporary directory, removed
            after a clean run and kept when a rank fails so its log can be read).
        on_metric: called as ``on_metric(rank, record)`` in the caller for each :func:`report`.

    Raises:
        ValueError: ``world_size`` < 1, unknown backend, or more NCCL ranks than GPUs.
        RankError: a rank raised or died; names the rank, carries its traceback. The other ranks
            are killed first; no process is left behind.
        TimeoutError: ``timeout`` elapsed (all ranks killed).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if under_torchrun():
        return _launch_torchrun(fn, world_size, args, kwargs, backend, on_metric)
    backend = resolve_backend(backend, world_size)
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"cannot send {fn!r} and its arguments to the ranks: {e}") from e
    own_logs = not log_dir  # a temporary log folder is removed again after a clean run
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="llmlab-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=_PG_TIMEOUT_S))
    threads = max(1, (os.cpu_count() or 1) // world_size) if backend == "gloo" else 1
    ctx = _context()
    procs = [ctx.Process(target=_entry, name=f"llmlab-rank{r}", daemon=False,
                         args=(r, world_size, backend, "127.0.0.1", store.port, payload,
                               str(log_dir), threads, dict(os.environ)))
             for r in range(world_size)]
    seen = [0] * world_size
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        with _main_module_hidden():
            for p in procs:
                p.start()
        while True:
            _drain(store, seen, on_metric)
            codes = [p.exitcode for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise _failure(store, procs, failed, log_dir)
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                err = TimeoutError(f"launch: ranks still running after {timeout} s "
                                   f"(logs in {log_dir})")
                err.log_dir = str(log_dir)  # kept for reading, like a RankError's
                raise err
            time.sleep(0.02)
        _drain(store, seen, on_metric)
        results = [cloudpickle.loads(store.get(f"res/{r}")) for r in range(world_size)]
        if own_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        return results
    finally:
        _stop(procs)
        del store


@contextlib.contextmanager
def _main_module_hidden():
    """Stop multiprocessing from re-running the caller's ``__main__`` script in each rank.

    ``fn`` travels by value, so ranks never need the caller's main module; re-importing it would
    re-run an unguarded script (and cannot work for a notebook kernel at all).
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


def _drain(store, seen, on_metric):
    if on_metric is None:
        return
    for r in range(len(seen)):
        n = store.add(f"n/{r}", 0)
        while seen[r] < n:
            seen[r] += 1
            on_metric(r, json.loads(store.get(f"m/{r}/{seen[r]}")))


def _failure(store, procs, failed, log_dir) -> RankError:
    """The error of the rank that failed first (``failed``: those seen dead at the first poll).

    Peers of a crashed rank fail afterwards with connection errors; those are not the cause. A
    rank killed by a signal leaves no error record, while its peers record their connection
    errors: when both are seen at the same poll, the killed rank is the cause.
    """
    killed = [r for r in failed if (procs[r].exitcode or 0) < 0 and not store.check([f"err/{r}"])]
    for r in [] if killed else failed:
        if store.check([f"err/{r}"]):
            tb = store.get(f"err/{r}").decode()
            last = tb.strip().splitlines()[-1] if tb.strip() else "error"
            return RankError(r, last, tb, str(log_dir))
    r = (killed or failed)[0]
    code = procs[r].exitcode
    how = (f"killed by signal {signal.Signals(-code).name}" if code < 0
           else f"exited with code {code}")
    tail = _tail(Path(log_dir) / f"rank{r}.log")
    return RankError(r, f"{how} (log: {log_dir}/rank{r}.log)", tail, str(log_dir))


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _stop(procs):
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    end = time.monotonic() + 3
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2)


def _launch_torchrun(fn, world_size, args, kwargs, backend, on_metric):
    env_ws = int(os.environ["WORLD_SIZE"])
    if env_ws != world_size:
        raise ValueError(f"world_size={world_size} does not match torchrun's WORLD_SIZE={env_ws}")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local % torch.cuda.device_count())
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=_PG_TIMEOUT_S))
    _channel.update(rank=dist.get_rank(), local_callback=on_metric)
    try:
        result = fn(*args, **kwargs)
        results = [None] * world_size
        dist.all_gather_object(results, result)
        return results
    finally:
        _channel.pop("local_callback", None)
        if own:
            dist.destroy_process_group()
