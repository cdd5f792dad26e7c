"""Hosts you can test on one machine: N network namespaces on a bridge, or loopback addresses.

A cluster has nodes, each with its own address and network link; a test or a lab has one machine.
:class:`Hosts` makes ``n`` "hosts" on this machine that look like nodes to ``torchrun``, gloo and
an HTTP client:

* **netns** (root, or ``CAP_NET_ADMIN``): one Linux network namespace per host (``llh-<pid>-<k>-h<i>``),
  each with loopback up and an ``eth0`` holding ``10.211.0.<i+1>/24``, its veth peer plugged into a
  bridge that lives in a namespace of its own (``...-sw``), so nothing is added to this machine's
  own network stack and two :class:`Hosts` never see each other's traffic. Each host has its own
  host name (``<prefix>-h<i>``, resolved to its address on every host through
  ``/etc/netns/<ns>/hosts``), so ``socket.getfqdn()`` (which torchrun's rendezvous publishes as
  ``MASTER_ADDR``) names the right host. Links may be rate-limited with ``tc``'s token bucket
  (``tbf``; this kernel has no ``netem``, so no added delay): :meth:`Hosts.shape`. Traffic
  between the ranks of one host uses its loopback, unshaped: the fast link inside a node.
* **loopback** (no namespaces can be made): host ``i`` is the address ``127.0.0.<i+2>``, processes
  run in this machine's stack, nothing is shaped, all hosts share one host name.
  :attr:`Hosts.mode` and :attr:`Hosts.reason` say which was made and why.

Processes started on a host (:meth:`Hosts.popen`) run under ``ip netns exec`` (and ``unshare --uts``
for the host name) and carry ``LLMLAB_HOST=<host name>`` in their environment, inherited by their
children (torchrun's workers), so :meth:`Hosts.signal` reaches everything running "on" a host, and
:meth:`Hosts.close` ends it all. Everything made (processes, namespaces with their links and
bridge, ``/etc/netns`` files) is removed by :meth:`Hosts.close`: on leaving the ``with`` block,
also on an exception or Ctrl-C, at interpreter exit (``atexit``), on ``SIGTERM`` (turned into
``SystemExit`` when no other handler is set), and, after a ``SIGKILL`` of the owner, by the next
:class:`Hosts` made on this machine (:func:`remove_stale`: namespaces whose owner pid is gone).

Source: the multi-node deployment of the source articles (head and worker nodes, fast links inside
a node, slower ones between); ``ip-netns(8)``, ``tc-tbf(8)``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

PREFIX = "llh"  # every namespace this module makes is named llh-<owner pid>-<k>-...
NETNS_ETC = Path("/etc/netns")
_counter = itertools.count()
_live: list["Hosts"] = []
_hooks_installed = False


class HostsError(RuntimeError):
    """Hosts could not be made, or a host operation is not possible in this mode."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise :class:`HostsError` with its stderr when it fails and ``check``."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here (``None`` when they can): no ``ip``/``tc``/
    ``unshare`` command, not root (namespaces, veth links and bridges need ``CAP_NET_ADMIN``)."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_NET_ADMIN)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces (and ``/etc/netns`` folders) of owners that no longer run (a test
    process killed with SIGKILL cannot clean up); returns their names. Live owners' are kept."""
    out = _ip("netns", "list", check=False).stdout if shutil.which("ip") else ""
    gone = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 4 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _kill_tagged(name.rsplit("-", 1)[0] + "-", signal.SIGKILL)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            gone.append(name)
    return gone


def _tagged_pids(tag_prefix: str) -> list[int]:
    """Processes whose ``LLMLAB_HOST`` starts with ``tag_prefix`` (read from /proc/<pid>/environ)."""
    want = f"LLMLAB_HOST={tag_prefix}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if any(item.startswith(want) for item in env.split(b"\0")):
            pids.append(int(d.name))
    return pids


def _kill_tagged(tag_prefix: str, sig: int) -> int:
    """Send ``sig`` to every process tagged ``tag_prefix``...; how many were signalled."""
    n = 0
    for pid in _tagged_pids(tag_prefix):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            n += 1
    return n


def _close_all() -> None:
    for h in list(_live):
        h.close()


def _install_hooks() -> None:
    """atexit closes every live Hosts; SIGTERM (when nobody else handles it) becomes SystemExit,
    so ``with`` blocks and atexit run."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
        signal.SIG_DFL,
        None,
    ):

        def _term(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _term)


class Hosts:
    """``n`` hosts on this machine (see the module docstring); a context manager.

    Args:
        n: number of hosts, >= 1 (at most 250).
        rate: link rate of each host's link (``tc`` syntax: ``"100mbit"``, ``"1gbit"``) or None.
        mode: ``"auto"`` (namespaces when possible, else loopback), ``"netns"`` (raise
            :class:`HostsError` when namespaces cannot be made) or ``"loopback"``; default:
            ``LLMLAB_HOSTS_MODE``, else ``"auto"``.

    Attributes: ``mode`` (what was made), ``reason`` (why loopback, else ""), ``addresses``,
    ``names`` (host names), ``interface`` (the network interface on every host: ``eth0``, or ``lo``).

    Raises ``ValueError`` for a bad ``n``/``mode``/``rate``, :class:`HostsError` when ``mode="netns"``
    cannot be honoured or an ``ip``/``tc`` command fails (what was made so far is removed first).
    """

    def __init__(self, n: int, *, rate: str | None = None, mode: str | None = None) -> None:
        mode = mode or os.environ.get("LLMLAB_HOSTS_MODE", "auto")
        if not isinstance(n, int) or not 1 <= n <= 250:
            raise ValueError(f"n={n!r}: expected 1 to 250 hosts")
        if mode not in ("auto", "netns", "loopback"):
            raise ValueError(f"mode={mode!r}: expected 'auto', 'netns' or 'loopback'")
        self.n = n
        self.rate: str | None = None
        self.prefix = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.names = [f"{self.prefix}-h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[Any]] = []
        self.closed = False
        why = netns_unavailable() if mode != "loopback" else "loopback asked for"
        if mode == "netns" and why:
            raise HostsError(f"cannot make network namespaces: {why}")
        self.mode, self.reason = ("loopback", why) if why else ("netns", "")
        _install_hooks()
        _live.append(self)
        try:
            if self.mode == "netns":
                remove_stale()
                self._make_namespaces()
            else:
                self.addresses = [f"127.0.0.{i + 2}" for i in range(n)]
                self.interface = "lo"
            if rate is not None:
                self.shape(rate)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- making
    @property
    def switch(self) -> str:
        """The namespace holding the bridge (netns mode)."""
        return f"{self.prefix}-sw"

    def _make_namespaces(self) -> None:
        self.addresses = [f"10.211.0.{i + 1}" for i in range(self.n)]
        self.interface = "eth0"
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        etc_hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {name}\n" for a, name in zip(self.addresses, self.names)
        )
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                f"h{i}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                name,
            )
            _ip("-n", self.switch, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / name / "hosts").write_text(etc_hosts)

    def shape(self, rate: str | None) -> None:
        """Limit every host's link to ``rate`` each way (``tc qdisc replace ... tbf``; e.g.
        ``"200mbit"``), or remove the limit (None). Raises :class:`HostsError` in loopback mode."""
        if self.mode != "netns":
            raise HostsError(f"links cannot be shaped in loopback mode ({self.reason})")
        if rate is not None and (not isinstance(rate, str) or not rate[:1].isdigit()):
            raise ValueError(f"rate={rate!r}: expected a tc rate such as '100mbit' or '1gbit'")
        for i, name in enumerate(self.names):
            for ns, dev in ((name, "eth0"), (self.switch, f"h{i}")):
                if rate is None:
                    subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                    continue
                # burst: at least one 64 KiB GSO packet; latency bounds the queue.
                proc = subprocess.run(
                    [
                        "tc",
                        "-n",
                        ns,
                        "qdisc",
                        "replace",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        "256kb",
                        "latency",
                        "100ms",
                    ],
                    capture_output=True,
                    text=True,
                )
                if proc.returncode != 0:
                    raise HostsError(f"tc tbf rate {rate} on {ns}/{dev} failed: {proc.stderr.strip()}")
        self.rate = rate

    # ---------------------------------------------------------------- using
    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on host ``i`` (in its namespace, with its host
        name), as a list for ``subprocess``."""
        self._check(i)
        if self.mode == "loopback":
            return list(argv)
        return [
            "ip",
            "netns",
            "exec",
            self.names[i],
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.names[i],
            *argv,
        ]

    def env(self, i: int, env: dict[str, str] | None = None) -> dict[str, str]:
        """``env`` (default: this process's) plus ``LLMLAB_HOST`` (the tag :meth:`signal` and
        :meth:`close` find processes by)."""
        self._check(i)
        return {**(os.environ if env is None else env), "LLMLAB_HOST": self.names[i]}

    def popen(
        self, i: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``i`` (a new session, so a Ctrl-C in a notebook reaches only the
        caller) and return its ``Popen``; ``kwargs`` go to ``subprocess.Popen``."""
        proc: subprocess.Popen[Any] = subprocess.Popen(
            self.command(i, argv), env=self.env(i, env), start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def run(
        self,
        i: int,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        timeout: float | None = 120,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on host ``i`` to completion (output captured as text); kills it after
        ``timeout`` s and raises ``subprocess.TimeoutExpired``."""
        proc = self.popen(i, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(i, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def pids(self, i: int, having: str | None = None) -> list[int]:
        """Every process running on host ``i`` that :meth:`popen` started, and their children;
        with ``having``, only those whose environment has that variable (``"LOCAL_RANK"``:
        torchrun's workers, not its agent)."""
        self._check(i)
        out = []
        for p in _tagged_pids(self.names[i]):
            env = _environ(p)
            # "-h1" would also match "-h10": tags are compared whole
            if env.get("LLMLAB_HOST") == self.names[i] and (having is None or having in env):
                out.append(p)
        return out

    def signal(self, i: int, sig: int = signal.SIGKILL, having: str | None = None) -> int:
        """Send ``sig`` to every process on host ``i`` (SIGKILL: the host dies; SIGSTOP: it
        hangs), or to those with the variable ``having`` (:meth:`pids`); returns how many."""
        n = 0
        for pid in self.pids(i, having):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                n += 1
        return n

    def disconnect(self, i: int, connected: bool = False) -> None:
        """Unplug host ``i``'s link from the bridge (it becomes unreachable), or plug it back
        (``connected=True``). Netns mode only."""
        self._check(i)
        if self.mode != "netns":
            raise HostsError(f"a link cannot be unplugged in loopback mode ({self.reason})")
        _ip("-n", self.switch, "link", "set", f"h{i}", "up" if connected else "down")

    @contextlib.contextmanager
    def entered(self, i: int) -> Iterator[None]:
        """Run the body with the *calling thread* in host ``i``'s network namespace (sockets made
        there, e.g. an HTTP client's, stay in it); a no-op in loopback mode."""
        self._check(i)
        if self.mode != "netns":
            yield
            return
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        clone_newnet = 0x40000000
        home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.names[i]}", os.O_RDONLY)
        try:
            if libc.setns(target, clone_newnet) != 0:
                raise HostsError(f"setns into {self.names[i]}: {os.strerror(ctypes.get_errno())}")
            try:
                yield
            finally:
                libc.setns(home, clone_newnet)
        finally:
            os.close(home)
            os.close(target)

    def describe(self) -> str:
        """One line: what was made, the addresses, the link rate."""
        if self.mode == "loopback":
            return (
                f"{self.n} hosts on loopback addresses {', '.join(self.addresses)} "
                f"(no network namespaces: {self.reason}; links not shaped)"
            )
        rate = f"links limited to {self.rate} (tbf)" if self.rate else "links not shaped"
        return (
            f"{self.n} hosts in network namespaces {self.names[0]}..{self.names[-1]}, "
            f"addresses {', '.join(self.addresses)} on interface {self.interface}, {rate}"
        )

    def _check(self, i: int) -> None:
        if self.closed:
            raise HostsError("these hosts were removed (close() was called)")
        if not isinstance(i, int) or not 0 <= i < self.n:
            raise ValueError(f"host {i!r}: expected 0 to {self.n - 1}")

    # ---------------------------------------------------------------- removing
    def close(self) -> None:
        """End every process started on the hosts (SIGTERM, 3 s, SIGKILL), then remove the
        namespaces (their links and bridge go with them) and ``/etc/netns`` files. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if _kill_tagged(self.prefix + "-", signal.SIGTERM):
            deadline = time.monotonic() + 3
            while _tagged_pids(self.prefix + "-") and time.monotonic() < deadline:
                time.sleep(0.05)
            _kill_tagged(self.prefix + "-", signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        if self.mode == "netns":
            for name in [*self.names, self.switch]:
                _ip("netns", "del", name, check=False)
                shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()  # only when empty: others may have theirs there
        if self in _live:
            _live.remove(self)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Hosts({self.describe()})"


def _environ(pid: int) -> dict[str, str]:
    """The environment of process ``pid`` ({} when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def leftovers(prefix: str) -> list[str]:
    """Namespaces and ``/etc/netns`` folders whose name starts with ``prefix`` (a test's check
    that nothing was left behind)."""
    out = _ip("netns", "list", check=False).stdout if shutil.which("ip") else ""
    names = [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]
    etc = [str(p) for p in NETNS_ETC.glob(f"{prefix}*")] if NETNS_ETC.is_dir() else []
    return names + etc


if __name__ == "__main__":  # pragma: no cover - `python -m llmlab.runtime.hosts 2`: a look
    with Hosts(int(sys.argv[1]) if len(sys.argv) > 1 else 2) as h:
        print(h.describe())
