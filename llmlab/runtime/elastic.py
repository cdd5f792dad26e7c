"""Training across nodes under ``torchrun``: the checks a rank makes before it joins, and the
commands that start ``torchrun`` on every host.

**Inside a rank** (:func:`check_torchrun_environment`, called by
:func:`llmlab.runtime.process.join_torchrun` before the process group is made): each of these
would otherwise end in a cryptic error or a wait of minutes, so it is refused at once with a
``ValueError`` naming the variable and the fix:

* ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` naming no interface of this host (gloo says
  "Unable to find address for: eth1" from C++; NCCL waits);
* a job over several nodes whose gloo sockets would sit on loopback (the interface variable names
  ``lo``, or is unset and the host name resolves to 127.x, as on many stock images): the other
  nodes would be told 127.0.0.1 and connect to themselves (allowed when ``MASTER_ADDR`` is itself
  a loopback address: then every node is on this machine, as :class:`Hosts` in loopback mode);
* ``--max-restarts K > 0`` with torchrun's shared rendezvous store (its default). torchrun's agent
  on node 0 hosts one ``TCPStore`` for the workers' ``env://`` rendezvous and keeps it across
  restarts (``DynamicRendezvousHandler._shared_tcp_store_server``), while the workers use it
  without a per-attempt prefix (``torch.distributed.rendezvous._create_c10d_store``: "we create a
  new TCPStore for every retry"). The restarted ranks then read the dead ranks' gloo addresses
  left in it and fail in ``connectFullMesh`` with "connection refused". With
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in every agent's environment, each round gets a fresh
  store (hosted by the new rank 0), and the restart works.

**Starting torchrun on hosts** (:func:`start_torchrun`, for :class:`~llmlab.runtime.hosts.Hosts`
or real nodes reached the same way): the c10d rendezvous on host 0 (``--rdzv-conf is_host=1``
there, so a port in use fails there instead of silently joining whoever holds it), each host's
own address as ``--local-addr``, the interface in ``GLOO_SOCKET_IFNAME``, the store sharing off.
Before any agent starts, :func:`preflight` checks that the rendezvous port is free on host 0 and
that every host reaches it: a ``ValueError`` naming the host, address and port otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from llmlab.runtime.hosts import Hosts

SHARED_STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


# --------------------------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------------------------
def ipv4_interfaces() -> dict[str, str | None]:
    """This host's network interfaces, name -> IPv4 address (``None`` for one without)."""
    out: dict[str, str | None] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    s.fileno(), 0x8915, struct.pack("256s", name[:15].encode())
                )  # SIOCGIFADDR
                out[name] = socket.inet_ntoa(packed[20:24])
            except OSError:
                out[name] = None
    return out


def _listing(ifaces: Mapping[str, str | None]) -> str:
    return ", ".join(f"{n} {a}" for n, a in ifaces.items() if a) or "none"


def _nccl_matches(spec: str, names: Sequence[str]) -> bool:
    """NCCL_SOCKET_IFNAME: comma-separated prefixes; ``=name`` exact; ``^...`` excludes (not checked)."""
    if spec.startswith("^"):
        return True
    exact = spec.startswith("=")
    wanted = [w for w in spec.lstrip("=").split(",") if w]
    return any(n == w if exact else n.startswith(w) for w in wanted for n in names)


def check_interface_variables(
    env: Mapping[str, str] | None = None,
    backend: str = "gloo",
    ifaces: Mapping[str, str | None] | None = None,
) -> None:
    """Refuse interface variables that cannot work on this host (see the module docstring).
    Raises ``ValueError`` naming the variable, its value, this host and its interfaces."""
    env = os.environ if env is None else env
    ifaces = ipv4_interfaces() if ifaces is None else ifaces
    host = socket.gethostname()
    nodes = int(env.get("WORLD_SIZE", "1")) // max(
        1, int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    )
    if env.get("MASTER_ADDR", "").startswith("127."):
        nodes = 1  # the nodes reach rank 0 on loopback: they are all on this machine
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo:
        for name in gloo.split(","):
            if not ifaces.get(name):
                raise ValueError(
                    f"GLOO_SOCKET_IFNAME={gloo}: host {host} has no interface {name!r} with an IPv4 "
                    f"address (here: {_listing(ifaces)}); set it to the interface that carries the "
                    f"traffic between nodes (the same name on every node), or unset it"
                )
            if nodes > 1 and backend == "gloo" and str(ifaces[name]).startswith("127."):
                raise ValueError(
                    f"GLOO_SOCKET_IFNAME={gloo} is loopback ({ifaces[name]}) but this job spans "
                    f"{nodes} nodes: the others could not reach host {host}; set it to the interface "
                    f"between nodes (here: {_listing(ifaces)})"
                )
    elif nodes > 1 and backend == "gloo":
        try:
            addr = socket.gethostbyname(host)
        except OSError:
            addr = None
        if addr is None or addr.startswith("127."):
            raise ValueError(
                f"this job spans {nodes} nodes, but host {host}'s name resolves to "
                f"{addr or 'nothing'}, so gloo would listen on loopback and the other nodes could "
                f"not reach it; set GLOO_SOCKET_IFNAME to the interface between nodes "
                f"(here: {_listing(ifaces)}) on every node"
            )
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if nccl and backend == "nccl" and not _nccl_matches(nccl, [n for n, a in ifaces.items() if a]):
        raise ValueError(
            f"NCCL_SOCKET_IFNAME={nccl}: no interface of host {host} matches it "
            f"(here: {_listing(ifaces)}); set it to the interface between nodes"
        )


def check_restart_store(env: Mapping[str, str] | None = None) -> None:
    """Refuse ``torchrun --max-restarts K > 0`` with the rendezvous store shared across restarts
    (``ValueError`` naming the fix, :data:`SHARED_STORE_FIX`; the cause is in the module docstring)."""
    env = os.environ if env is None else env
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ValueError(
            f"torchrun --max-restarts {restarts} with its shared rendezvous store: after a restart "
            f"the new ranks would read the dead ranks' addresses from it and fail in gloo's "
            f"connectFullMesh ('connection refused'). Start torchrun with {SHARED_STORE_FIX} in its "
            f"environment on every node (each restart then gets a fresh store)"
        )


def check_torchrun_environment(backend: str, env: Mapping[str, str] | None = None) -> None:
    """Every check a torchrun rank makes before it joins (see the module docstring)."""
    check_restart_store(env)
    check_interface_variables(env, backend)


# --------------------------------------------------------------------------------------------
# Starting torchrun on hosts
# --------------------------------------------------------------------------------------------
_PROBE = (
    "import socket,sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
    "except OSError as e:\n"
    "    sys.exit(f'{type(e).__name__}: {e}')\n"
)


def preflight(hosts: Hosts, port: int = 0, timeout: float = 3.0) -> int:
    """Before any agent starts: bind the rendezvous port on host 0 (``0``: one the OS picks) and
    connect to it from every other host. Returns the port. Raises ``ValueError`` naming the
    constraint: the port in use on host 0, or a host that cannot reach host 0's address."""
    head = hosts.addresses[0]
    with hosts.entered(0):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            sock.bind((head, port))
        except OSError as e:
            raise ValueError(
                f"rendezvous port {port} is in use on host 0 ({head}): {e.strerror}; "
                f"pick another --rdzv-endpoint port (or 0 for a free one)"
            ) from None
        sock.listen(8)
        port = sock.getsockname()[1]
        for i in range(1, hosts.n):
            got = hosts.run(
                i, [sys.executable, "-c", _PROBE, head, str(port), str(timeout)], timeout=timeout + 30
            )
            if got.returncode != 0:
                raise ValueError(
                    f"host {i} ({hosts.addresses[i]}) cannot reach the rendezvous "
                    f"endpoint {head}:{port} on host 0: {got.stderr.strip()[-200:]}"
                )
    finally:
        sock.close()
    return port


def torchrun_argv(
    args: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    run_id: str,
    head: bool,
    local_addr: str | None = None,
    max_restarts: int = 0,
    module: str = "llmlab",
) -> list[str]:
    """``python -m torch.distributed.run`` for one node of a c10d-rendezvous job running
    ``python -m <module> <args>``."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"is_host={int(head)}",
        "--max-restarts",
        str(max_restarts),
    ]
    if local_addr:
        argv += ["--local-addr", local_addr]
    return argv + ["-m", module, *args]


def node_env(
    interface: str | None, base: Mapping[str, str] | None = None, threads: int = 1
) -> dict[str, str]:
    """A node's environment for torchrun: the gloo interface, the rendezvous store fresh at
    every restart (:data:`SHARED_STORE_FIX`), ``threads`` OpenMP threads a rank."""
    env = dict(os.environ if base is None else base)
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS=str(threads))
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface
    return env


@dataclass
class NodeJob:
    """torchrun running on every host: ``procs[i]`` (its agent) logs to ``logs[i]``."""

    hosts: Hosts
    procs: list[subprocess.Popen[Any]]
    logs: list[Path]
    endpoint: str
    started: float = field(default_factory=time.monotonic)

    def output(self, i: int) -> str:
        """What host ``i``'s torchrun (agent and ranks) printed so far."""
        try:
            return self.logs[i].read_text(errors="replace")
        except OSError:
            return ""

    def wait(self, timeout: float = 300, grace: float = 60) -> list[int]:
        """Exit codes of every host's torchrun. When one fails, the others get ``grace`` s to end
        too; past ``timeout`` (or the grace) everything on the hosts is killed and
        ``TimeoutError`` raised with the hosts' last lines."""
        deadline = self.started + timeout
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return [int(c) for c in codes]  # type: ignore[arg-type]
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() > deadline:
                self.kill()
                tails = "\n".join(
                    f"--- host {i}:\n" + "\n".join(self.output(i).splitlines()[-15:])
                    for i in range(len(self.procs))
                )
                raise TimeoutError(
                    f"torchrun still running on some hosts after {timeout} s (codes {codes}); killed\n{tails}"
                )
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL everything this job runs on every host."""
        for i in range(len(self.procs)):
            self.hosts.signal(i, signal.SIGKILL, "LLMLAB_RUN_ID")
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(10)


def start_torchrun(
    hosts: Hosts,
    args: Sequence[str],
    *,
    nproc_per_node: int,
    log_dir: str | os.PathLike[str],
    max_restarts: int = 0,
    port: int = 0,
    env: Mapping[str, str] | None = None,
    interface: str | None = None,
    module: str = "llmlab",
) -> NodeJob:
    """Start ``torchrun ... -m <module> <args>`` on every host of ``hosts`` (one node each), after
    :func:`preflight`; ``interface``: ``GLOO_SOCKET_IFNAME`` (default: the hosts' interface).
    Returns the :class:`NodeJob`; nothing is started when a check fails."""
    port = preflight(hosts, port)
    endpoint = f"{hosts.addresses[0]}:{port}"
    run_id = f"llmlab-{uuid.uuid4().hex[:8]}"
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    base = node_env(interface or hosts.interface, env)
    base["LLMLAB_RUN_ID"] = run_id  # on the agents and their ranks: what kill() ends
    for i in range(hosts.n):
        argv = torchrun_argv(
            args,
            nnodes=hosts.n,
            nproc_per_node=nproc_per_node,
            endpoint=endpoint,
            run_id=run_id,
            head=i == 0,
            local_addr=hosts.addresses[i],
            max_restarts=max_restarts,
            module=module,
        )
        logs.append(Path(log_dir) / f"host{i}.log")
        with open(logs[-1], "w") as out:
            procs.append(hosts.popen(i, argv, env=base, stdout=out, stderr=subprocess.STDOUT))
    return NodeJob(hosts, procs, logs, endpoint)
