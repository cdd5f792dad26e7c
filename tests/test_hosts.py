"""runtime/hosts.py: N hosts on one machine (network namespaces on a bridge, else loopback
addresses), processes on them, shaped links, and nothing left behind however the owner ends."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from llmlab.runtime.hosts import Hosts, HostsError, leftovers, netns_unavailable

NETNS = pytest.mark.skipif(
    netns_unavailable() is not None, reason=f"network namespaces: {netns_unavailable()}"
)
ECHO = (
    "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
    "s.bind(('0.0.0.0',int(sys.argv[1]))); s.listen(1); print('up',flush=True);"
    "c,a=s.accept(); c.sendall(socket.gethostname().encode()); c.close()"
)
ASK = (
    "import socket,sys; c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=5);"
    "print(c.recv(100).decode())"
)


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


@NETNS
def test_two_namespace_hosts_talk_by_address_and_name_and_are_removed():
    with Hosts(2) as h:
        assert h.mode == "netns" and h.reason == "" and h.interface == "eth0"
        assert h.addresses == ["10.211.0.1", "10.211.0.2"]
        srv = h.popen(1, [sys.executable, "-c", ECHO, "7001"], stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "up"
        # by name: host 1's name resolves to its address on host 0; the answer is host 1's name
        got = h.run(0, [sys.executable, "-c", ASK, h.names[1], "7001"])
        assert got.returncode == 0, got.stderr
        assert got.stdout.strip() == h.names[1]
        fqdn = h.run(0, [sys.executable, "-c", "import socket; print(socket.getfqdn())"]).stdout
        assert fqdn.strip() == h.names[0]
        # this machine's own stack does not see the hosts' network
        assert (
            subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout.count("10.211.") == 0
        )
        sleeper = h.popen(0, ["sleep", "60"])
        time.sleep(0.2)
        assert h.pids(0) and not h.pids(1)
        prefix = h.prefix
    assert leftovers(prefix) == []
    assert _gone(sleeper.pid) and _gone(srv.pid)


@NETNS
def test_shaped_links_carry_a_tbf_qdisc_and_an_unplugged_host_is_unreachable():
    with Hosts(2, rate="200mbit") as h:
        show = subprocess.run(
            ["tc", "-n", h.names[0], "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        assert "tbf" in show and "200Mbit" in show
        h.shape(None)
        show = subprocess.run(
            ["tc", "-n", h.names[0], "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        assert "tbf" not in show
        h.disconnect(1)
        got = h.run(0, [sys.executable, "-c", ASK, h.addresses[1], "7001"], timeout=30)
        assert got.returncode != 0 and ("No route to host" in got.stderr or "timed out" in got.stderr)


@NETNS
def test_an_exception_or_sigterm_or_sigkill_of_the_owner_leaves_nothing(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with Hosts(1) as h:
            p = h.popen(0, ["sleep", "60"])
            1 / 0
    assert leftovers(h.prefix) == [] and p.wait(5) is not None
    owner = textwrap.dedent("""
        import sys, time
        from llmlab.runtime.hosts import Hosts
        h = Hosts(2)
        h.popen(1, ["sleep", "60"])
        print(h.prefix, flush=True)
        time.sleep(60)
    """)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
        prefix = proc.stdout.readline().strip()
        assert len(leftovers(prefix)) == 5  # 2 hosts, the switch, 2 /etc/netns folders
        proc.send_signal(sig)
        proc.wait(10)
        if sig == signal.SIGKILL:  # no cleanup could run: the next Hosts removes the stale ones
            Hosts(1).close()
        assert leftovers(prefix) == []
        from llmlab.runtime.hosts import _tagged_pids

        assert _tagged_pids(prefix + "-") == []


def test_loopback_hosts_have_their_own_addresses_and_say_why():
    with Hosts(3, mode="loopback") as h:
        assert h.mode == "loopback" and h.reason and h.interface == "lo"
        assert h.addresses == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        assert "loopback" in h.describe() and h.reason in h.describe()
        with pytest.raises(HostsError, match="loopback mode"):
            h.shape("100mbit")
        srv = h.popen(
            2,
            [sys.executable, "-c", ECHO.replace("0.0.0.0", h.addresses[2]), "7002"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert srv.stdout.readline().strip() == "up"
        got = h.run(0, [sys.executable, "-c", ASK, h.addresses[2], "7002"])
        assert got.returncode == 0 and got.stdout.strip(), got.stderr
        p = h.popen(1, ["sleep", "60"])
        time.sleep(0.2)
        assert h.pids(1) == [p.pid] and h.pids(0) == []
        assert h.signal(1, signal.SIGKILL) == 1
        assert p.wait(5) == -signal.SIGKILL
        q = h.popen(0, ["sleep", "60"])
    assert q.wait(5) is not None


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="1 to 250"):
        Hosts(0)
    with pytest.raises(ValueError, match="mode="):
        Hosts(2, mode="vm")
    if netns_unavailable() is None:
        with pytest.raises(ValueError, match="tc rate"):
            Hosts(1, rate="fast")
    with Hosts(1, mode="loopback") as h:
        with pytest.raises(ValueError, match="expected 0 to 0"):
            h.popen(1, ["true"])
    with pytest.raises(HostsError, match="removed"):
        h.popen(0, ["true"])
    if os.geteuid() != 0:
        with pytest.raises(HostsError, match="CAP_NET_ADMIN"):
            Hosts(1, mode="netns")
