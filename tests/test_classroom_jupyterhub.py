"""The classroom recipe for real: JupyterHub started with ``classroom/jupyterhub_config.py``.

One hub (demo mode: JupyterHub's shared-password authenticator, SimpleLocalProcessSpawner),
``configurable-http-proxy`` from npm (``.ci/run`` installs it into ``.ci/node``), the instructor's
API token from the config. Two learners log in (one through the login form, a wrong password
refused; one created by the instructor) and their servers are started through the hub's REST API;
their servers' device sets (the CPU cores each process is pinned to, ``CUDA_VISIBLE_DEVICES``) must
be disjoint; a third learner is refused (the node has two seats) until a server stops. The first
code cells of lab 00 (the copy in the learner's home) then run in one learner's server through the
Jupyter server's kernel REST and websocket API, behind the hub's proxy, with an exercise check
whose outcome lands in the room's results. The hub is given ``CUDA_VISIBLE_DEVICES=`` and two of
this machine's cores, so the node is shared as a CPU-only node of two one-core seats wherever the
test runs (CI has two cores and no GPU).

Every wait has a deadline; the hub and every process under it (proxy, culler, servers, kernels)
are stopped at the end, killed if they do not stop.
"""
import http.cookiejar
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
import websocket

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "classroom" / "jupyterhub_config.py"
TOKEN = uuid.uuid4().hex
PASSWORD = uuid.uuid4().hex[:12]


def _chp_dir() -> str:
    local = ROOT / ".ci" / "node" / "node_modules" / ".bin"
    if (local / "configurable-http-proxy").exists():
        return str(local)
    found = shutil.which("configurable-http-proxy")
    assert found, ("configurable-http-proxy is not installed: .ci/run installs it "
                   "(npm install --prefix .ci/node configurable-http-proxy@4)")
    return str(Path(found).parent)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Hub:
    def __init__(self, base: str):
        self.base = base

    def api(self, method: str, path: str, body=None, timeout: float = 20):
        req = urllib.request.Request(f"{self.base}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {TOKEN}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                data = r.read()
                return r.status, json.loads(data) if data else None
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def wait_ready(self, user: str, proc, deadline: float) -> dict:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the hub exited"
            status, model = self.api("GET", f"/hub/api/users/{user}")
            server = model.get("servers", {}).get("") if status == 200 else None
            if server and server.get("ready"):
                return server
            time.sleep(0.5)
        raise TimeoutError(f"{user}'s server was not ready in time")


def _log_in(base: str, user: str, password: str) -> bool:
    """A learner's login through the hub's form (the shared-password authenticator of demo mode);
    True when the hub answers with its login cookie."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    opener.open(f"{base}/hub/login", timeout=20).read()           # sets the _xsrf cookie
    xsrf = next(c.value for c in jar if c.name == "_xsrf")
    form = urllib.parse.urlencode({"username": user, "password": password, "_xsrf": xsrf}).encode()
    try:
        opener.open(f"{base}/hub/login?next=", data=form, timeout=60).read()
    except urllib.error.HTTPError:
        pass                                  # the redirect to a server that is not started yet
    return any(c.name == "jupyterhub-hub-login" for c in jar)


def _run_cells(base: str, user: str, cells: list[str], timeout: float) -> list[dict]:
    """Execute ``cells`` in a new kernel of ``user``'s server; one {status, stdout, error} each."""
    hub = Hub(base)
    status, kernel = hub.api("POST", f"/user/{user}/api/kernels", {"name": "python3"}, timeout=60)
    assert status == 201, kernel
    ws = websocket.create_connection(
        f"ws://{base.split('://')[1]}/user/{user}/api/kernels/{kernel['id']}/channels",
        header=[f"Authorization: token {TOKEN}"], timeout=timeout)
    results = []
    try:
        for code in cells:
            msg_id = uuid.uuid4().hex
            ws.send(json.dumps({"header": {"msg_id": msg_id, "msg_type": "execute_request",
                                           "username": user, "session": uuid.uuid4().hex,
                                           "version": "5.3"},
                                "parent_header": {}, "metadata": {}, "channel": "shell",
                                "content": {"code": code, "silent": False, "store_history": True,
                                            "user_expressions": {}, "allow_stdin": False}}))
            out, error, reply, idle = [], None, None, False
            end = time.monotonic() + timeout
            while not (reply and idle):
                assert time.monotonic() < end, f"cell did not finish in {timeout} s: {code[:80]!r}"
                m = json.loads(ws.recv())
                if m.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = m["header"]["msg_type"]
                if kind == "stream":
                    out.append(m["content"]["text"])
                elif kind == "error":
                    error = "\n".join(m["content"]["traceback"])
                elif kind == "execute_reply":
                    reply = m["content"]["status"]
                elif kind == "status" and m["content"]["execution_state"] == "idle":
                    idle = True
            results.append({"status": reply, "stdout": "".join(out), "error": error})
            if reply != "ok":
                break
    finally:
        ws.close()
        hub.api("DELETE", f"/user/{user}/api/kernels/{kernel['id']}")
    return results


def _server_devices(pid: int) -> tuple[set[int], dict]:
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    return os.sched_getaffinity(pid), env


def _stop(proc, servers: list[int]) -> None:
    """SIGTERM the hub (it stops its servers and proxy), then kill whatever is left under it, and
    the servers seen (in case the hub died first and they were re-parented)."""
    tree = []
    for pid in [proc.pid, *servers]:
        try:
            p = psutil.Process(pid)
            if pid != proc.pid and "jupyterhub" not in " ".join(p.cmdline()):
                continue                          # that server is gone and its pid reused
            tree += ([p] if pid != proc.pid else []) + p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    gone, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=5)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two one-core seats need two cores")
def test_jupyterhub_classroom_two_learners_disjoint_devices_and_lab00_through_the_hub(tmp_path):
    port, hub_port, api_port = _free_ports(3)
    two = set(sorted(os.sched_getaffinity(0))[:2])  # the hub's node: two cores, so two one-core seats
    env = {**os.environ, "PATH": os.pathsep.join([_chp_dir(), os.environ["PATH"]]),
           "LLMLAB_HUB_MODE": "demo", "LLMLAB_HUB_STATE_DIR": str(tmp_path),
           "LLMLAB_HUB_API_TOKEN": TOKEN, "LLMLAB_HUB_CORES_PER_LEARNER": "1",
           "LLMLAB_HUB_PASSWORD": PASSWORD,
           "CUDA_VISIBLE_DEVICES": "", "LLMLAB_LIVE": "0"}
    log = open(tmp_path / "hub.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(CONFIG), "--ip=127.0.0.1",
                             f"--port={port}", f"--JupyterHub.hub_port={hub_port}",
                             f"--ConfigurableHTTPProxy.api_url=http://127.0.0.1:{api_port}"],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: os.sched_setaffinity(0, two))
    hub = Hub(f"http://127.0.0.1:{port}")
    server_pids: list[int] = []
    try:
        deadline = time.monotonic() + 120  # the hub imports torch (llmlab doctor's inventory)
        while not (_up(port) and hub.api("GET", "/hub/api/")[0] == 200):
            assert proc.poll() is None, "the hub exited:\n" + (tmp_path / "hub.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the hub did not answer in 120 s"
            time.sleep(0.3)
        assert not _log_in(hub.base, "alice", "wrong-password")
        assert _log_in(hub.base, "alice", PASSWORD)              # alice logs in herself...
        assert hub.api("POST", "/hub/api/users/bob")[0] == 201   # ...bob is added by the instructor
        for user in ("alice", "bob"):                            # their servers start
            status, body = hub.api("POST", f"/hub/api/users/{user}/server")
            assert status in (201, 202), body
        deadline = time.monotonic() + 120
        servers = {u: hub.wait_ready(u, proc, deadline) for u in ("alice", "bob")}
        server_pids += [s["state"]["pid"] for s in servers.values()]

        devices = {u: _server_devices(s["state"]["pid"]) for u, s in servers.items()}
        (cores_a, env_a), (cores_b, env_b) = devices["alice"], devices["bob"]
        assert len(cores_a) == len(cores_b) == 1 and not cores_a & cores_b, devices
        assert {env_a["LLMLAB_SEAT"], env_b["LLMLAB_SEAT"]} == {"0", "1"}
        for cores, e in devices.values():
            assert e["LLMLAB_CPU_CORES"] == ",".join(map(str, sorted(cores)))
            assert e["OMP_NUM_THREADS"] == "1" and e.get("CUDA_VISIBLE_DEVICES", "") == ""  # no GPU handed out
        assert hub.api("POST", "/hub/api/users/carol")[0] == 201
        status, body = hub.api("POST", "/hub/api/users/carol/server")  # the room is full
        assert status == 429, (status, body)

        nb = json.loads((tmp_path / "home" / "alice" / "labs" / "00_three_walls.ipynb").read_text())
        code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"][:2]
        probe = ("import json, os, llmlab; from llmlab.runtime.hardware import usable_cores\n"
                 "from llmlab import check; from llmlab.solutions import lab00\n"
                 "assert check.training_memory_bytes(lab00.training_memory_bytes)\n"
                 "print(json.dumps({'cores': sorted(os.sched_getaffinity(0)), 'usable': usable_cores(),"
                 " 'size': size.as_dict(), 'file': llmlab.__file__}))")
        res = _run_cells(hub.base, "alice", code + [probe], timeout=180)
        assert [r["status"] for r in res] == ["ok"] * 3, res
        assert "lab size:" in res[0]["stdout"], res[0]
        seen = json.loads(res[2]["stdout"].strip().splitlines()[-1])
        assert seen["cores"] == sorted(cores_a) and seen["usable"] == 1
        assert seen["size"]["cpu_cores"] == 1 and seen["size"]["device"] == "cpu"
        assert Path(seen["file"]).resolve() == ROOT / "llmlab" / "__init__.py"
        solved = json.loads((tmp_path / "results" / "alice.json").read_text())   # the room's results
        assert solved["learner"] == "alice" and solved["exercises"]["training_memory_bytes"]["solved"]

        assert hub.api("DELETE", "/hub/api/users/bob/server")[0] in (202, 204)
        deadline = time.monotonic() + 30
        while hub.api("GET", "/hub/api/users/bob")[1]["servers"]:
            assert time.monotonic() < deadline, "bob's server did not stop in 30 s"
            time.sleep(0.3)
        status, body = hub.api("POST", "/hub/api/users/carol/server")  # bob's seat is free again
        assert status in (201, 202), body
        carol = hub.wait_ready("carol", proc, time.monotonic() + 90)
        server_pids.append(carol["state"]["pid"])
        assert _server_devices(carol["state"]["pid"])[0] == cores_b
    except BaseException:
        log.flush()
        lines = (tmp_path / "hub.log").read_text().splitlines()  # shown by pytest with the failure
        print("\n".join(line for line in lines if "GET /hub/api/users/" not in line)[-8000:])
        raise
    finally:
        _stop(proc, server_pids)
        log.close()


def _up(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0
