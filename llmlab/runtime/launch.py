"""Run a function on N real processes: from a script, a notebook cell, or under ``torchrun``.

``launch(fn, world_size, *args)`` starts ``world_size`` processes, initialises a
``torch.distributed`` process group in each (gloo on CPU, NCCL with one GPU per rank on CUDA),
calls ``fn(*args, **kwargs)`` on every rank and returns the list of per-rank return values.

How (measured on a 2-core CPU box; the processes are started, and the backend picked, by
:mod:`llmlab.runtime.process`):

* ranks are forked from a *forkserver* that has imported only ``torch``: after the server's first
  start (~2 s), 4 ranks start in ~0.1 s, and no learner-editable module is cached in it;
* ``fn`` and its arguments travel by value with ``cloudpickle``, so a function defined in a
  notebook cell works (it must not capture unpicklable objects such as open files or locks);
* rendezvous goes through a ``TCPStore`` the caller hosts on an OS-chosen port (never a fixed
  port) bound to the loopback interface, which also carries results, errors and live metrics
  (:func:`report`); gloo's own sockets use loopback too unless ``GLOO_SOCKET_IFNAME`` is set;
* the store has no authentication (anyone who reaches its port can write any key), so every value
  llmlab puts in it carries an HMAC-SHA256 tag under a secret made fresh for each launch, which
  reaches the ranks through the fork server's local pipe, never the network. The caller checks the
  tag *before* decoding anything: a forged or tampered result (a crafted pickle, say) raises
  :class:`ForgedValueError` naming the rank and key, and none of it is decoded or executed
  (the tags and the JSON round trip are in :mod:`llmlab.runtime.result_auth`).
  Results are pickled (``cloudpickle``) only after that check; metric records are JSON,
  tracebacks text;
* each rank writes its stdout/stderr to ``<log_dir>/rank<r>.log`` (rank prints would vanish or
  land in a random notebook cell), dies with its parent (``PR_SET_PDEATHSIG``), and if a rank
  raises, the others are killed and :class:`RankError` carries its rank and traceback.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` already set, one or several nodes),
``launch`` joins that rank's process group with ``env://``, runs ``fn`` once and returns every
rank's result, gathered as raw bytes (never ``all_gather_object``, which unpickles what arrives
from the network). There is no parent to make a secret, so the user may give one: with
``LLMLAB_SECRET`` (or ``LLMLAB_SECRET_FILE``, a file holding it) set to the same value on every
node, results are pickled and HMAC-tagged like a local launch's; without it they travel as JSON
(None, bool, int, float, str, list, tuple, dict) and anything else is refused with a ``TypeError``
before it is sent.
"""

from __future__ import annotations

import json
import os
import secrets
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

from llmlab.runtime import process
from llmlab.runtime.result_auth import (
    ForgedValueError,
    _from_json,
    _sign,
    _to_json,
    _verified,
    _verified_torchrun,
    torchrun_secret,
)


class RankError(RuntimeError):
    """A rank failed. ``rank`` is its global rank, ``rank_traceback`` the traceback text,
    ``log_dir`` the folder holding every rank's ``rank<r>.log`` (kept after a failure for reading;
    the caller may remove it)."""

    def __init__(self, rank: int, message: str, rank_traceback: str = "", log_dir: str | None = None) -> None:
        self.rank, self.rank_traceback, self.log_dir = rank, rank_traceback, log_dir
        super().__init__(f"rank {rank} failed: {message}\n{rank_traceback}".rstrip())


# --------------------------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------------------------
_channel: dict[str, Any] = {}


def report(record: dict[str, Any]) -> None:
    """Send a JSON-serialisable record from this rank to the caller's ``on_metric`` callback.

    A no-op outside :func:`launch` (e.g. a single process or under torchrun without a callback).
    Raises ``TypeError`` if ``record`` is not a dict that JSON can encode.
    """
    if not isinstance(record, dict):
        raise TypeError(f"report() takes a dict, got {type(record).__name__}")
    store, rank = _channel.get("store"), _channel.get("rank")
    if store is None:
        cb = _channel.get("local_callback")
        if cb is not None:
            cb(_channel.get("rank", 0), record)
        return
    body = json.dumps(record).encode()
    i = _channel["n"] = _channel.get("n", 0) + 1
    store.set(f"m/{rank}/{i}", _sign(_channel["secret"], f"m/{rank}/{i}", body))
    store.add(f"n/{rank}", 1)


def _entry(
    rank: int,
    world_size: int,
    backend: str,
    host: str,
    port: int,
    payload: bytes,
    log_dir: Any,
    threads: int,
    env: dict[str, Any],
    secret: bytes,
) -> None:
    log = open(Path(log_dir) / f"rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    store: Any = None  # the rendezvous TCPStore (bytes values)
    try:
        process.setup_child(env, threads, backend, rank)
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
        )
        store = process.join_store(host, port)
        _channel.update(store=store, rank=rank, secret=secret)
        process.init_process_group(backend, store, rank, world_size)
        fn, args, kwargs = cloudpickle.loads(payload)  # from the caller, over the fork server's local pipe
        result = fn(*args, **kwargs)
        store.set(f"res/{rank}", _sign(secret, f"res/{rank}", cloudpickle.dumps(result)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything must reach the caller
        tb = traceback.format_exc()
        print(tb, flush=True)
        if store is not None:
            try:
                # "<order>\n<traceback>": order 1 is the first rank to fail (its peers fail later,
                # when its sockets close), whichever the caller sees dead first
                order = store.add("errors", 1)
                store.set(f"err/{rank}", _sign(secret, f"err/{rank}", f"{order}\n{tb}".encode()))
            except Exception:  # noqa: BLE001
                pass
        log.flush()
        os._exit(1)
    log.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# The caller
# --------------------------------------------------------------------------------------------
under_torchrun = process.under_torchrun
resolve_torchrun_backend = process.resolve_torchrun_backend


def resolve_backend(backend: str, world_size: int) -> str:
    """``auto`` -> NCCL when CUDA has at least ``world_size`` GPUs on this node, else gloo
    (:func:`llmlab.runtime.process.resolve_backend`).

    Raises ``ValueError`` for an unknown backend, or NCCL with more ranks than GPUs.
    """
    return process.resolve_backend(backend, world_size)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    on_metric: Callable[[int, dict[str, Any]], None] | None = None,
    **kwargs: Any,
) -> list[Any]:
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
        ForgedValueError: a result, traceback or metric record in the store does not carry this
            launch's HMAC tag (another process wrote it); it is not decoded.
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
    store = process.loopback_store()
    secret = secrets.token_bytes(32)  # travels to the ranks with the payload, over local pipes
    threads = process.child_threads(world_size, backend)
    env = process.local_env(backend)
    procs = []
    try:
        for r in range(world_size):
            entry_args = (
                r,
                world_size,
                backend,
                "127.0.0.1",
                store.port,
                payload,
                str(log_dir),
                threads,
                env,
                secret,
            )
            procs.append(process.start(_entry, entry_args, name=f"llmlab-rank{r}"))
        _wait(procs, store, secret, on_metric, timeout, log_dir)
        try:
            # verified before unpickling: only bytes a rank of this launch signed are decoded
            return [
                cloudpickle.loads(_verified(secret, r, f"res/{r}", _get(store, r, f"res/{r}")))
                for r in range(world_size)
            ]
        finally:  # every rank finished cleanly: its log holds nothing to read
            if own_logs:
                shutil.rmtree(log_dir, ignore_errors=True)
    finally:
        process.stop(procs)
        del store


def _wait(
    procs: list[Any], store: Any, secret: bytes, on_metric: Any, timeout: float | None, log_dir: Any
) -> None:
    """Poll until every rank exited cleanly, passing metric records on; raise the first rank's
    error (:class:`RankError`) or ``TimeoutError`` after ``timeout`` s."""
    seen = [0] * len(procs)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        _drain(store, secret, seen, on_metric)
        codes = [p.exitcode for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise _failure(store, secret, procs, failed, log_dir)
        if all(c == 0 for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            err = TimeoutError(f"launch: ranks still running after {timeout} s (logs in {log_dir})")
            err.log_dir = str(log_dir)  # type: ignore[attr-defined]  # kept for reading, like a RankError's
            raise err
        time.sleep(0.02)
    _drain(store, secret, seen, on_metric)


def _get(store: Any, rank: int, key: str) -> bytes:
    """``store.get`` of a key a rank must have written; a missing one (deleted by another
    process) is reported at once instead of blocking for the store's timeout."""
    if not store.check([key]):
        raise ForgedValueError(rank, key, "missing: deleted from the store")
    value: bytes = store.get(key)
    return value


def _drain(store: Any, secret: bytes, seen: list[int], on_metric: Any) -> None:
    """Pass every new record to ``on_metric``: tag checked, then JSON decoded, then checked to
    be a dict. A rank writes ``m/<r>/<i>`` before counting it in ``n/<r>``, so a count ahead of
    its records was raised by someone else."""
    if on_metric is None:
        return
    for r in range(len(seen)):
        try:
            n = store.add(f"n/{r}", 0)
        except Exception as e:  # noqa: BLE001 - a counter overwritten with non-numeric bytes
            raise ForgedValueError(r, f"n/{r}", f"not a counter: {e}") from None
        while seen[r] < n:
            key = f"m/{r}/{seen[r] + 1}"
            if not store.check([key]):
                raise ForgedValueError(r, f"n/{r}", f"counts {n} records but {key!r} is missing")
            body = _verified(secret, r, key, store.get(key))
            try:
                record = json.loads(body)
            except ValueError as e:  # signed by our own rank, so a bug rather than an attack
                raise RuntimeError(f"rank {r}: metric record {key!r} is not JSON: {e}") from None
            if not isinstance(record, dict):
                raise RuntimeError(f"rank {r}: metric record {key!r} is not a JSON object")
            seen[r] += 1
            on_metric(r, record)


def _failure(store: Any, secret: bytes, procs: list[Any], failed: list[Any], log_dir: Any) -> RankError:
    """The error of the rank that failed first (``failed``: those seen dead at the first poll).

    Peers of a crashed rank fail afterwards with connection errors; those are not the cause: when
    several error records are seen at once, the first one written is. A rank killed by a signal leaves no error record, while its peers record their connection
    errors: when both are seen at the same poll, the killed rank is the cause.
    """
    killed = [r for r in failed if (procs[r].exitcode or 0) < 0 and not store.check([f"err/{r}"])]
    errors = {}  # rank -> (order of failure, traceback text)
    for r in [] if killed else failed:
        if store.check([f"err/{r}"]):
            body = _verified(secret, r, f"err/{r}", store.get(f"err/{r}")).decode("utf-8", "replace")
            order, _, tb = body.partition("\n")
            errors[r] = (int(order) if order.isdigit() else sys.maxsize, tb)
    if errors:
        r = min(errors, key=lambda k: errors[k][0])
        tb = errors[r][1]
        last = tb.strip().splitlines()[-1] if tb.strip() else "error"
        return RankError(r, last, tb, str(log_dir))
    r = (killed or failed)[0]
    code = procs[r].exitcode
    how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    tail = _tail(Path(log_dir) / f"rank{r}.log")
    return RankError(r, f"{how} (log: {log_dir}/rank{r}.log)", tail, str(log_dir))


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _launch_torchrun(
    fn: Any, world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any], backend: str, on_metric: Any
) -> list[Any]:
    env_ws = int(os.environ["WORLD_SIZE"])
    if env_ws != world_size:
        raise ValueError(f"world_size={world_size} does not match torchrun's WORLD_SIZE={env_ws}")
    secret = torchrun_secret()
    _, own = process.join_torchrun(backend)
    _channel.update(rank=dist.get_rank(), local_callback=on_metric)
    try:
        result = fn(*args, **kwargs)
        return _exchange_results(result, secret)
    finally:
        _channel.pop("local_callback", None)
        if own:
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Under torchrun: results travel between ranks as bytes, pickled only when authenticated
# --------------------------------------------------------------------------------------------
def _exchange_results(result: Any, secret: bytes | None) -> list[Any]:
    """Every rank's ``result``, by rank. Each rank sends one blob, ``mode || body``:
    ``P`` + cloudpickle (only with a secret, then the blob is HMAC-tagged), ``J`` + tagged JSON,
    or ``E`` + the reason its result could not be encoded (then every rank raises ``TypeError``).
    """
    rank = dist.get_rank()
    key = f"res/{rank}"
    try:
        blob = b"P" + cloudpickle.dumps(result) if secret else b"J" + json.dumps(_to_json(result)).encode()
    except Exception as e:  # noqa: BLE001 - told to every rank, so none waits forever
        hint = (
            ""
            if secret
            else (
                " (without LLMLAB_SECRET results travel as JSON: None, bool, int, "
                "float, str, list, tuple, dict; set LLMLAB_SECRET to the same "
                "value on every node to return anything cloudpickle can send)"
            )
        )
        blob = b"E" + f"{type(e).__name__}: {e}{hint}".encode()
    if secret:
        blob = _sign(secret, key, blob)
    where = dict(where="received from the process group")
    results: list[Any] = []
    errors: list[str] = []
    for r, got in enumerate(_all_gather_bytes(blob)):
        if secret:  # checked before anything of it is decoded
            got = _verified_torchrun(secret, r, got)
        mode, body = got[:1], got[1:]
        if mode == b"E":
            errors.append(f"rank {r}: cannot send its result: {body.decode('utf-8', 'replace')}")
            results.append(None)
        elif mode == b"P" and secret:
            results.append(cloudpickle.loads(body))
        elif mode == b"J":
            try:
                results.append(_from_json(json.loads(body)))
            except ValueError as e:
                raise ForgedValueError(r, f"res/{r}", f"not llmlab's JSON encoding: {e}", **where) from None
        else:
            raise ForgedValueError(
                r, f"res/{r}", f"unexpected kind {mode!r}; is LLMLAB_SECRET set on every node?", **where
            )
    if errors:
        raise TypeError("\n".join(errors))
    return results


def _all_gather_bytes(data: bytes) -> list[bytes]:
    """``all_gather`` of byte strings of any lengths, as uint8 tensors (no pickle involved)."""
    world = dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    size_ts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(size_ts, n)
    sizes = [int(s.item()) for s in size_ts]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(outs, buf.to(device))
    return [o[:k].cpu().numpy().tobytes() for o, k in zip(outs, sizes)]
