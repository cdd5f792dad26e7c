"""Serving across hosts on Ray, on hosts made on one machine (:class:`~llmlab.runtime.hosts.Hosts`)
or typed by hand on real nodes (docs/workshop.md): the source articles' steps 1, 2 and 5.

:class:`RayCluster` runs ``ray start --head`` on host 0 and ``ray start --address HEAD:PORT`` on
every other host (each ``--block``, so the processes stay this object's; ``--num-cpus`` small and a
temporary directory of its own), and waits until every node has joined. A raylet gives its Python
agents 15 s to report their ports and aborts otherwise (seen on a loaded 2-core machine); such an
abort is read from the raylet's log at once and that node is started again. :class:`ClusterServer`
runs ``llmlab serve --distributed-executor-backend ray`` on host 0 (the head: HTTP server,
scheduler and sampling stay there) with ``RAY_ADDRESS`` set, and waits for its "serving" line.
The tests use these; lab 13's serving step is to call :func:`serve_across_hosts` and
:func:`lose_a_node`::

    from llmlab.runtime.hosts import Hosts
    from llmlab.serve.cluster import serve_across_hosts
    with Hosts(2) as hosts:
        with serve_across_hosts(hosts, tensor_parallel_size=2, pipeline_parallel_size=2) as server:
            print(server.complete("ROMEO:", max_tokens=16))   # TP inside a host, PP across

A killed node's actors are noticed at once (their connections reset); a node that falls silent is
declared dead after about ``health_check_s`` x 5 seconds (``RAY_health_check_*`` for ``ray start``;
Ray's defaults take longer). Then ``/health`` answers 503 and the requests in flight fail. :meth:`RayCluster.stop` ends every process it started and removes its directory.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ray_bin() -> str:
    found = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    if not os.path.exists(found):
        raise NotImplementedError("serving on a Ray cluster needs Ray: pip install 'llmlab[cluster]'")
    return found


class RayCluster:
    """A Ray cluster over ``hosts``: the head on host 0, a worker node on each other host.

    ``num_cpus``: the CPUs each node offers Ray (one per worker rank; an int, or one per host).
    ``health_check_s``: seconds between Ray's node health checks (5 misses: the node is dead).
    Raises ``TimeoutError`` (with the nodes' logs) when the nodes have not joined within
    ``start_timeout`` s; what was started is stopped first."""

    def __init__(
        self,
        hosts: Any,
        *,
        num_cpus: int | list[int] = 2,
        health_check_s: float = 1.0,
        start_timeout: float = 240.0,
    ) -> None:
        self.hosts = hosts
        self.num_cpus = [num_cpus] * hosts.n if isinstance(num_cpus, int) else list(num_cpus)
        if len(self.num_cpus) != hosts.n:
            raise ValueError(f"num_cpus: {len(self.num_cpus)} values for {hosts.n} hosts")
        self.health_check_s, self.start_timeout = health_check_s, start_timeout
        self.temp_dir = tempfile.mkdtemp(prefix="llr", dir="/tmp")  # short: Ray's socket paths
        head = hosts.addresses[0]
        self.port = 6379 if hosts.mode == "netns" else _free_port(head)
        self.address = f"{head}:{self.port}"
        self.procs: list[subprocess.Popen[Any]] = []
        self.logs: list[str] = []

    def env(self) -> dict[str, str]:
        """The environment of ``ray start`` and of the processes that use the cluster."""
        ms = str(int(self.health_check_s * 1000))
        # a killed node's actors are noticed at once (their connections reset); the health checks
        # find a silent one, and on a loaded 2-core machine must not declare a slow one dead
        return {
            **os.environ,
            "RAY_ADDRESS": self.address,
            "RAY_health_check_period_ms": ms,
            "RAY_health_check_timeout_ms": str(3 * int(ms)),
            "RAY_health_check_failure_threshold": "5",
            "RAY_raylet_start_wait_time_s": "180",
            "RAY_health_check_initial_delay_ms": "0",
            "RAY_prestart_worker_first_driver": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_DEDUP_LOGS": "0",
        }

    def _start_node(self, i: int) -> None:
        common = [
            "--block",
            "--node-ip-address",
            self.hosts.addresses[i],
            "--num-cpus",
            str(self.num_cpus[i]),
            "--num-gpus",
            "0",
            "--object-store-memory",
            str(80 * 2**20),
            "--disable-usage-stats",
        ]
        role = (
            ["--head", "--port", str(self.port), "--include-dashboard", "false", "--temp-dir", self.temp_dir]
            if i == 0
            else ["--address", self.address]
        )
        log = os.path.join(self.temp_dir, f"ray-start-h{i}.log")
        with open(log, "a") as f:  # "a": a retry's output follows
            self.procs.append(
                self.hosts.popen(
                    i,
                    [_ray_bin(), "start", *role, *common],
                    env=self.env(),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
        if log not in self.logs:
            self.logs.append(log)

    def start(self) -> "RayCluster":
        try:
            for i in range(self.hosts.n):  # the head first: a worker node
                self._start_node_retrying(i)  # gives up if it is slow to come up
            self.wait_for_nodes(self.hosts.n, self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node_retrying(self, i: int, attempts: int = 3) -> None:
        """Start host ``i``'s node and wait for its "Ray runtime started" line. Ray's raylet gives
        its Python agents 15 s to report their ports and aborts when they miss it (on a loaded
        machine their imports take longer); ``ray start`` would then wait minutes for a raylet
        that is gone. So a raylet abort is noticed in its log at once and the node started again
        (``attempts`` times in all)."""
        for attempt in range(1, attempts + 1):
            aborts = self._raylet_aborts()
            self._start_node(i)
            why = self._wait_started(i, aborts, self.start_timeout)
            if why is None:
                return
            self._stop_host(i)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.procs[-1].pid, signal.SIGKILL)
            self.procs.pop().wait(10)
            if attempt == attempts:
                raise TimeoutError(
                    f"Ray's node on host {i} did not start ({attempts} attempts; "
                    f"last: {why}). A raylet waits 15 s for its Python agents to report their "
                    f"ports: is the machine overloaded?\n{self.tail()}"
                )

    def _raylet_aborts(self) -> list[str]:
        """The raylets of this cluster that aborted: one line of each's log (its "Check failed")."""
        found = []
        for log in sorted(glob.glob(os.path.join(self.temp_dir, "session_2*", "logs", "raylet*.out"))):
            with contextlib.suppress(OSError), open(log, errors="replace") as f:
                line = next((x for x in f if " C " in x[:40] and "Check failed" in x), None)
                if line is not None:
                    found.append(line.split("Check failed", 1)[1].strip()[:300])
        return found

    def _wait_started(self, i: int, aborts_before: list[str], timeout: float) -> str | None:
        """None once host ``i``'s ``ray start`` says "Ray runtime started"; else why not (its
        raylet aborted, ``ray start`` exited, or ``timeout`` s passed)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with contextlib.suppress(OSError), open(self.logs[i], errors="replace") as f:
                if f.read().count("Ray runtime started") > 0:
                    return None
            aborts = self._raylet_aborts()
            if len(aborts) > len(aborts_before):
                return f"the raylet aborted: {aborts[-1]}"
            if self.procs[-1].poll() is not None:
                return f"`ray start` exited with {self.procs[-1].returncode}"
            time.sleep(0.5)
        return f'no "Ray runtime started" within {timeout:g} s'

    def wait_for_nodes(self, n: int, timeout: float) -> None:
        """Wait until ``n`` nodes are alive (a short Ray driver on host 0 asks the head)."""
        code = (
            "import ray, sys, time\n"
            f"ray.init(address={self.address!r}, logging_level='ERROR')\n"
            f"end = time.monotonic() + {timeout}\n"
            f"while sum(x['Alive'] for x in ray.nodes()) < {n} and time.monotonic() < end:\n"
            "    time.sleep(0.5)\n"
            "print(sum(x['Alive'] for x in ray.nodes()))\n"
        )
        deadline = time.monotonic() + timeout
        while True:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"`ray start` exited early:\n{self.tail()}")
            left = deadline - time.monotonic()
            try:
                out = self.hosts.run(0, [sys.executable, "-c", code], env=self.env(), timeout=left + 30)
            except subprocess.TimeoutExpired:
                out = None
            if out is not None and out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{n} Ray nodes did not join within {timeout:g} s:\n"
                    f"{'' if out is None else out.stderr[-2000:]}\n{self.tail()}"
                )
            time.sleep(1.0)

    def tail(self, chars: int = 3000) -> str:
        """The end of each node's ``ray start`` output."""
        parts = []
        for i, log in enumerate(self.logs):
            with contextlib.suppress(OSError), open(log) as f:
                parts.append(f"--- host {i}:\n{f.read()[-chars:]}")
        return "\n".join(parts)

    def kill_node(self, i: int) -> int:
        """SIGKILL every process on host ``i`` (its raylet, its workers, ...): the node is lost."""
        return int(self.hosts.signal(i, signal.SIGKILL))

    def stop(self) -> None:
        """End every Ray process of this cluster (each host's ``ray start`` and what it started:
        they carry the host's tag) and remove its directory. Idempotent."""
        for i in range(self.hosts.n):
            with contextlib.suppress(Exception):
                self._stop_host(i)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        self.procs.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _stop_host(self, i: int) -> None:
        if self.hosts.closed:
            return
        mine = [p for p in self.hosts.pids(i) if self._is_ray(p)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in mine:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            end = time.monotonic() + 3
            while sig == signal.SIGTERM and any(_alive(p) for p in mine) and time.monotonic() < end:
                time.sleep(0.1)

    def _is_ray(self, pid: int) -> bool:
        """A process of this cluster: its command line names this cluster's directory or it is
        one of Ray's own (``ray::...``, workers started by a raylet of this cluster)."""
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            return False
        return (
            self.temp_dir in cmd
            or cmd.startswith("ray::")
            or "ray start" in cmd.replace("\0", " ")
            or "/ray/" in cmd
        )

    def __enter__(self) -> "RayCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class ClusterServer:
    """``llmlab serve --distributed-executor-backend ray`` on host 0 of ``cluster``.

    ``args``: more ``llmlab serve`` flags. :meth:`start` waits for the "serving" line (raising
    ``RuntimeError`` with the server's output if it exits first, ``TimeoutError`` after
    ``start_timeout`` s); :meth:`request` and :meth:`health` speak HTTP from inside host 0's network
    (:meth:`~llmlab.runtime.hosts.Hosts.entered`)."""

    def __init__(
        self,
        cluster: RayCluster,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        model: str = "shakespeare",
        args: tuple[str, ...] = (),
        start_timeout: float = 300.0,
    ) -> None:
        self.cluster, self.hosts = cluster, cluster.hosts
        self.host = self.hosts.addresses[0]
        self.port = 8000 if self.hosts.mode == "netns" else _free_port(self.host)
        self.argv = [
            sys.executable,
            "-m",
            "llmlab",
            "serve",
            "--model",
            model,
            "--distributed-executor-backend",
            "ray",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(tensor_parallel_size),
            "--pipeline-parallel-size",
            str(pipeline_parallel_size),
            "--data-parallel-size",
            str(data_parallel_size),
            *map(str, args),
        ]
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ClusterServer":
        env = self.cluster.env()
        env.setdefault("LLMLAB_RAY_PLACEMENT_TIMEOUT", "60")
        self.proc = self.hosts.popen(
            0, self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        if not ready.wait(self.start_timeout):
            self.stop()
            raise TimeoutError(
                f"llmlab serve did not start within {self.start_timeout:g} s:\n" + "".join(self.output[-40:])
            )
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"llmlab serve exited with {self.proc.returncode}:\n" + "".join(self.output[-60:])
            )
        return self

    def _read(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if "llmlab serve: serving" in line:
                ready.set()
        ready.set()  # exited: start() reports it

    def placement(self) -> dict[int, list[str]]:
        """``{stage: [node address, ...]}`` from the server's "Ray placement" line (one address per
        stage when its ranks share a node)."""
        line = next((x for x in self.output if "Ray placement:" in x), "")
        return {
            int(s): addrs.split(", ")
            for s, addrs in re.findall(r"stage (\d+) ranks \d+-\d+ on ([\d., ]+?)(?:;|$)", line.strip())
        }

    def request(
        self, path: str, body: dict[str, Any] | None = None, timeout: float = 60.0
    ) -> tuple[int, Any]:
        """``(status, JSON body)`` of a GET (or, with ``body``, a POST) to ``path``."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with self.hosts.entered(0):
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    raw, status = r.read(), r.status
            except urllib.error.HTTPError as e:
                raw, status = e.read(), e.code
        try:
            return status, json.loads(raw or b"{}")
        except json.JSONDecodeError:
            return status, {"raw": raw.decode(errors="replace")}

    def health(self, timeout: float = 5.0) -> int:
        """``/health``'s status code (0 when the server does not answer)."""
        try:
            return self.request("/health", timeout=timeout)[0]
        except OSError:
            return 0

    def complete(self, prompt: str, max_tokens: int = 16, **fields: Any) -> Any:
        """A greedy ``/v1/completions`` answer (raises ``RuntimeError`` for an error status)."""
        status, out = self.request(
            "/v1/completions",
            {"model": "shakespeare", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields},
        )
        if status != 200:
            raise RuntimeError(f"/v1/completions answered {status}: {out}")
        return out

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (running requests get ``--shutdown-timeout``), then SIGKILL. Idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def __enter__(self) -> "ClusterServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def lose_a_node(server: ClusterServer, host: int = 1, timeout: float = 30.0) -> dict[str, Any]:
    """Kill every process on ``host`` (a worker node) while a long request runs on ``server``;
    returns ``seconds_to_503`` (until ``/health`` answers 503), ``seconds_to_fail`` (until the
    request in flight got its answer), and that answer's ``request_status`` and ``request_error``.
    Raises ``TimeoutError`` when either takes longer than ``timeout`` s (a hang)."""
    answer: dict[str, Any] = {}

    def long_request() -> None:
        status, body = server.request(
            "/v1/completions",
            {
                "model": "shakespeare",
                "prompt": "ROMEO:",
                "max_tokens": 480,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=timeout + 60,
        )
        answer.update(status=status, body=body, at=time.monotonic())

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    end = time.monotonic() + 60
    while "llmlab:num_requests_running{" not in _running(server) and time.monotonic() < end:
        time.sleep(0.2)  # until the request is in the engine
    killed = time.monotonic()
    server.cluster.kill_node(host)
    while server.health() != 503:
        if time.monotonic() - killed > timeout:
            raise TimeoutError(f"/health still answers 200 {timeout:g} s after host {host} died")
        time.sleep(0.2)
    to_503 = time.monotonic() - killed
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"the request in flight was not answered {timeout:g} s after host {host} died")
    error = answer["body"].get("error", {})
    return {
        "seconds_to_503": to_503,
        "seconds_to_fail": answer["at"] - killed,
        "request_status": answer["status"],
        "request_error": error.get("message") if isinstance(error, dict) else str(error),
    }


def _running(server: ClusterServer) -> str:
    """The ``num_requests_running`` lines of ``/metrics`` whose value is not 0."""
    req = urllib.request.Request(server.url + "/metrics")
    with server.hosts.entered(0):
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return ""
    return "".join(
        line
        for line in text.splitlines(keepends=True)
        if line.startswith("llmlab:num_requests_running{") and not line.rstrip().endswith(" 0.0")
    )


@contextlib.contextmanager
def serve_across_hosts(
    hosts: Any,
    *,
    tensor_parallel_size: int = 2,
    pipeline_parallel_size: int = 2,
    data_parallel_size: int = 1,
    num_cpus: int | None = None,
    args: tuple[str, ...] = (),
) -> Iterator[ClusterServer]:
    """Lab 13's step 5: a Ray cluster over ``hosts`` and ``llmlab serve`` on it, TP inside a host
    and PP across (see the module docstring); yields the started :class:`ClusterServer` (its
    ``.cluster`` the :class:`RayCluster`); both are stopped on leaving."""
    cpus = num_cpus if num_cpus is not None else tensor_parallel_size * data_parallel_size
    with RayCluster(hosts, num_cpus=cpus) as cluster:
        with ClusterServer(
            cluster,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            args=args,
        ) as server:
            yield server
