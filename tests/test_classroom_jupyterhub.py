"""The isolated classroom for real: JupyterHub started as root with ``classroom/jupyterhub_config.py``
(system mode: PAM logins, every learner's server as that learner's Unix account), over TLS.

Three learner accounts are made for the test (``useradd``, prefix ``llroom``; removed at the end
even on failure). ``configurable-http-proxy`` comes from npm (``.ci/run`` installs it into
``.ci/node``); the certificate is a self-signed one for 127.0.0.1 made with ``openssl``. Learner A
logs in through the login form (PAM; a wrong password refused), B is added by the instructor, and
their servers are started with the instructor's token, which can start servers but not enter one.
Checked: each server runs as its learner with a private home, on disjoint cores; a third learner
is refused (two seats); the first cells of lab 00 and an exercise check run in A's kernel behind
the hub's TLS proxy; and code in A's kernel finds no hub secret (the instructor's token, the
cookie secret, the proxy's token: not in its environment, not in any process environment or
command line it can read, not in a file it can open: the state folder, the database and the
secret are closed to it), cannot list or read B's home, is refused by B's server, and cannot
forge, squat or replace B's results; ``llmlab classroom results`` then shows each learner's own row.
A second, smaller hub runs demo mode (no isolation, loopback only): its required shared password
logs a learner in, a wrong one does not, and the learner's server starts.

The learners' servers run this test's Python. Where it lives under a folder closed to other
accounts (``/root`` is 0700 on most machines), the hub runs in a private mount namespace in which
``/root`` is a 0711 tmpfs holding only ``.pyenv``; nothing changes outside it. The hub is given
``CUDA_VISIBLE_DEVICES=`` and two of this machine's cores, so the node is shared as a CPU-only node
of two one-core seats wherever the test runs. Every wait has a deadline; the hub and every process
under it are stopped at the end, killed if they do not stop, and every learner process too.
"""

import http.cookiejar
import json
import os
import pwd
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
import websocket

from llmlab.classroom.isolation import unreachable

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "classroom" / "jupyterhub_config.py"
TOKEN = uuid.uuid4().hex
PREFIX = f"llroom{uuid.uuid4().hex[:4]}"


def _chp_dir() -> str:
    local = ROOT / ".ci" / "node" / "node_modules" / ".bin"
    if (local / "configurable-http-proxy").exists():
        return str(local)
    found = shutil.which("configurable-http-proxy")
    assert found, (
        "configurable-http-proxy is not installed: .ci/run installs it "
        "(npm install --prefix .ci/node configurable-http-proxy@4)"
    )
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
    def __init__(self, base: str, cafile: str | None = None):
        self.base, self.cafile = base, cafile
        self.ctx = ssl.create_default_context(cafile=cafile) if cafile else None

    def api(self, method: str, path: str, body=None, token: str = TOKEN, timeout: float = 20):
        req = urllib.request.Request(
            f"{self.base}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.ctx) as r:
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

    def log_in(self, user: str, password: str) -> bool:
        """A learner's login through the hub's form (PAM, or demo mode's shared password); True when
        the hub sets its login cookie."""
        jar = http.cookiejar.CookieJar()
        handlers = [urllib.request.HTTPSHandler(context=self.ctx)] if self.ctx else []
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar), *handlers)
        opener.open(f"{self.base}/hub/login", timeout=20).read()  # sets the _xsrf cookie
        xsrf = next(c.value for c in jar if c.name == "_xsrf")
        form = urllib.parse.urlencode({"username": user, "password": password, "_xsrf": xsrf}).encode()
        try:
            opener.open(f"{self.base}/hub/login?next=", data=form, timeout=60).read()
        except urllib.error.HTTPError:
            pass  # the redirect to a server that is not started yet
        return any(c.name == "jupyterhub-hub-login" for c in jar)

    def run_cells(self, user: str, token: str, cells: list[str], timeout: float) -> list[dict]:
        """Execute ``cells`` in a new kernel of ``user``'s server; one {status, stdout, error} each."""
        status, kernel = self.api("POST", f"/user/{user}/api/kernels", {"name": "python3"}, token, timeout=60)
        assert status == 201, kernel
        ws = websocket.create_connection(
            f"wss://{self.base.split('://')[1]}/user/{user}/api/kernels/{kernel['id']}/channels",
            header=[f"Authorization: token {token}"],
            timeout=timeout,
            sslopt={"ca_certs": self.cafile},
        )
        try:
            return [_execute(ws, user, code, timeout) for code in cells]
        finally:
            ws.close()
            self.api("DELETE", f"/user/{user}/api/kernels/{kernel['id']}", token=token)


def _execute(ws, user: str, code: str, timeout: float) -> dict:
    msg_id = uuid.uuid4().hex
    ws.send(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "msg_type": "execute_request",
                    "username": user,
                    "session": uuid.uuid4().hex,
                    "version": "5.3",
                },
                "parent_header": {},
                "metadata": {},
                "channel": "shell",
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": True,
                    "user_expressions": {},
                    "allow_stdin": False,
                },
            }
        )
    )
    out, err, error, reply, idle = [], [], None, None, False
    end = time.monotonic() + timeout
    while not (reply and idle):
        assert time.monotonic() < end, f"cell did not finish in {timeout} s: {code[:80]!r}"
        m = json.loads(ws.recv())
        if m.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = m["header"]["msg_type"]
        if kind == "stream":
            (out if m["content"]["name"] == "stdout" else err).append(m["content"]["text"])
        elif kind == "error":
            error = "\n".join(m["content"]["traceback"])
        elif kind == "execute_reply":
            reply = m["content"]["status"]
        elif kind == "status" and m["content"]["execution_state"] == "idle":
            idle = True
    return {"status": reply, "stdout": "".join(out), "stderr": "".join(err), "error": error}


def _server_pid(uid: int) -> int:
    """The pid of the Jupyter server that runs as ``uid`` (its kernels are its children)."""
    found = [
        p.pid
        for p in psutil.process_iter(["uids", "cmdline"])
        if p.info["uids"] and p.info["uids"].real == uid and "jupyterhub.singleuser" in p.info["cmdline"]
    ]
    assert len(found) == 1, found
    return found[0]


def _server_devices(pid: int) -> tuple[set[int], dict]:
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    return os.sched_getaffinity(pid), env


def _stop(proc, uids: list[int]) -> None:
    """SIGTERM the hub (it stops its servers and proxy), then kill whatever is left under it and
    every process of the learners' accounts."""
    tree = []
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for p in psutil.process_iter(["uids"]):
        if p.info["uids"] and p.info["uids"].real in uids:
            tree.append(p)
    gone, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=5)


@pytest.fixture
def learners():
    """Three learner accounts {letter: (name, password)}; removed at the end, whatever happened."""
    made = {}
    try:
        for k in "abc":
            name, password = f"{PREFIX}{k}", uuid.uuid4().hex[:16]
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True, capture_output=True)
            made[k] = (name, password)
            subprocess.run(["chpasswd"], input=f"{name}:{password}", text=True, check=True)
        yield made
    finally:
        for name, _ in made.values():
            subprocess.run(["userdel", "-r", "-f", name], capture_output=True)


def _hub_command(args: list[str]) -> list[str]:
    """The hub's command line: as is, or in a private mount namespace where /root is passable."""
    if not unreachable(sys.executable):
        return args
    hidden = f"/tmp/{PREFIX}-root"
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        f"mkdir -p {hidden} && mount --bind /root {hidden} && mount -t tmpfs -o mode=0711 tmpfs /root"
        f" && mkdir /root/.pyenv && mount --bind {hidden}/.pyenv /root/.pyenv && umount {hidden}"
        f' && rmdir {hidden} && exec "$@"',
        "sh",
        *args,
    ]


def _probe_of_a(state: Path, results: Path, b: str, b_port: int) -> str:
    """The code a hostile learner A runs in her kernel; prints what it could reach, as JSON."""
    return f"""
import json, os, socket, urllib.request, urllib.error
from pathlib import Path
seen = {{"env": dict(os.environ), "proc": [], "denied": {{}}, "opened": []}}
for p in Path("/proc").iterdir():
    for f in ("environ", "cmdline"):
        try:
            seen["proc"].append((p / f).read_bytes().decode(errors="replace"))
        except (OSError, ValueError):
            pass
def attempt(what, fn):
    try:
        fn(); seen["opened"].append(what)
    except PermissionError:
        seen["denied"][what] = True
state, results = Path({str(state)!r}), Path({str(results)!r})
attempt("list state", lambda: os.listdir(state))
for f in ("jupyterhub.sqlite", "jupyterhub_cookie_secret", "jupyterhub.sqlite-journal"):
    try:
        open(state / f, "rb").read(); seen["opened"].append(f)
    except PermissionError:
        seen["denied"][f] = True
    except FileNotFoundError:
        pass
attempt("list b home", lambda: os.listdir(Path("/home/{b}")))
attempt("read b notebook", lambda: open("/home/{b}/labs/00_three_walls.ipynb").read())
attempt("list results", lambda: os.listdir(results))
attempt("squat results", lambda: os.mkdir(results / "{PREFIX}c"))
attempt("link in results", lambda: os.symlink("/dev/zero", results / "x"))
attempt("write b record", lambda: open(results / "{b}" / "results.json", "w"))
attempt("link in b folder", lambda: os.symlink("/dev/zero", results / "{b}" / ".lock"))
req = urllib.request.Request("http://127.0.0.1:{b_port}/user/{b}/api/kernels",
                             headers={{"Authorization": "token " + os.environ["JUPYTERHUB_API_TOKEN"]}})
try:
    urllib.request.urlopen(req, timeout=20); seen["b server"] = 200
except urllib.error.HTTPError as e:
    seen["b server"] = e.code
from llmlab import check
from llmlab.solutions import lab00
def wrong(num_params, bytes_per_param=4, optimizer_states=2):
    return {{"params": 0, "grads": 0, "optimizer_states": 0}}
os.environ["LLMLAB_LEARNER"] = "{b}"                  # forging: recorded as B? (cannot write there)
check.training_memory_bytes(wrong)
del os.environ["LLMLAB_LEARNER"]
check.training_memory_bytes(lab00.training_memory_bytes)
mine = results / os.environ["JUPYTERHUB_USER"] / "results.json"
data = json.loads(mine.read_text()); data["learner"] = "{b}"
mine.write_text(json.dumps(data))                    # a record that claims to be B's
seen["uid"], seen["home mode"] = os.getuid(), oct(os.stat(Path.home()).st_mode & 0o777)
from ipykernel.connect import get_connection_info    # the kernel's channels: Unix sockets, private
info = get_connection_info(unpack=True)
seen["kernel channels"] = (info["transport"], oct(os.stat(os.path.dirname(info["ip"])).st_mode & 0o777))
print(json.dumps(seen))
"""


def _start_isolated_hub(state: Path, certs: Path, port: int, log) -> subprocess.Popen:
    """JupyterHub with the recipe in system mode, as root, serving TLS on 127.0.0.1:``port`` with a
    self-signed certificate made in ``certs``, on two of this machine's cores (two one-core seats)."""
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(certs / "key.pem"),
            "-out",
            str(certs / "cert.pem"),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    hub_port, api_port = _free_ports(2)
    two = set(sorted(os.sched_getaffinity(0))[:2])
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMLAB_")}
    env.update(
        {
            "PATH": os.pathsep.join([_chp_dir(), os.environ["PATH"]]),
            "PYTHONPATH": str(ROOT),
            "LLMLAB_HUB_MODE": "system",
            "LLMLAB_HUB_STATE_DIR": str(state),
            "LLMLAB_HUB_IP": "127.0.0.1",
            "LLMLAB_HUB_PORT": str(port),
            "LLMLAB_HUB_API_PORT": str(hub_port),
            "LLMLAB_HUB_PROXY_API_PORT": str(api_port),
            "LLMLAB_HUB_SSL_CERT": str(certs / "cert.pem"),
            "LLMLAB_HUB_SSL_KEY": str(certs / "key.pem"),
            "LLMLAB_HUB_API_TOKEN": TOKEN,
            "LLMLAB_HUB_CORES_PER_LEARNER": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "LLMLAB_LIVE": "0",
        }
    )
    return subprocess.Popen(
        _hub_command([sys.executable, "-m", "jupyterhub", "-f", str(CONFIG)]),
        cwd=state,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: os.sched_setaffinity(0, two),
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="the isolated room makes learner accounts: needs root")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two one-core seats need two cores")
def test_isolated_room_two_learners_cannot_reach_each_other_or_the_hubs_secrets(learners):
    (a, a_pw), (b, _), (c, _) = learners["a"], learners["b"], learners["c"]
    uids = [pwd.getpwnam(n).pw_uid for n in (a, b, c)]
    state = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-state-"))
    certs = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-tls-"))
    port = _free_ports(1)[0]
    log = open(certs / "hub.log", "w")
    proc = None
    try:
        proc = _start_isolated_hub(state, certs, port, log)
        hub = Hub(f"https://127.0.0.1:{port}", str(certs / "cert.pem"))
        _wait_up(hub, port, proc, certs / "hub.log")
        _listens_on_loopback(port)
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # no plain HTTP
            urllib.request.urlopen(f"http://127.0.0.1:{port}/hub/api/", timeout=10).read()
        assert not hub.log_in(a, "wrong-password")
        assert hub.log_in(a, a_pw)  # A logs in herself (PAM)...
        for user in (b, c):
            assert hub.api("POST", f"/hub/api/users/{user}")[0] == 201  # ...B and C added by the instructor
        for user in (a, b):  # their servers start
            status, body = hub.api("POST", f"/hub/api/users/{user}/server")
            assert status in (201, 202), body
        deadline = time.monotonic() + 120
        for u in (a, b):
            hub.wait_ready(u, proc, deadline)
        pids = {u: _server_pid(uid) for u, uid in zip((a, b), uids)}  # (the instructor cannot see state)
        assert hub.api("POST", f"/hub/api/users/{c}/server")[0] == 429  # the room is full

        devices = {u: _server_devices(pid) for u, pid in pids.items()}
        (cores_a, env_a), (cores_b, env_b) = devices[a], devices[b]
        assert len(cores_a) == len(cores_b) == 1 and not cores_a & cores_b, devices
        assert {env_a["LLMLAB_SEAT"], env_b["LLMLAB_SEAT"]} == {"0", "1"}
        for user, uid in zip((a, b), uids):
            assert psutil.Process(pids[user]).uids().effective == uid  # the learner, never root
            home = os.stat(f"/home/{user}")
            assert home.st_mode & 0o777 == 0o700 and home.st_uid == uid
            folder = os.stat(state / "results" / user)
            assert folder.st_uid == uid and folder.st_mode & 0o777 == 0o700
        for f in ("jupyterhub.sqlite", "jupyterhub_cookie_secret", "jupyterhub-proxy.pid"):
            st = os.stat(state / f)
            assert st.st_uid == 0 and st.st_mode & 0o077 == 0, (f, oct(st.st_mode))
        assert os.stat(state).st_mode & 0o777 == 0o711 and os.stat(state / "results").st_mode & 0o777 == 0o711

        token_a = env_a["JUPYTERHUB_API_TOKEN"]  # A's own server token
        assert hub.api("GET", f"/user/{a}/api/kernels")[0] == 403  # the instructor cannot enter a server
        nb = json.loads((Path(f"/home/{a}") / "labs" / "00_three_walls.ipynb").read_text())
        code = ["".join(cell["source"]) for cell in nb["cells"] if cell["cell_type"] == "code"][:2]
        b_port = urllib.parse.urlparse(env_b["JUPYTERHUB_SERVICE_URL"]).port  # B's server, not via the proxy
        probe = _probe_of_a(state, state / "results", b, b_port)
        res = hub.run_cells(a, token_a, code + [probe], timeout=180)
        assert [r["status"] for r in res] == ["ok"] * 3, res
        assert "lab size:" in res[0]["stdout"], res[0]
        seen = json.loads(res[2]["stdout"].strip().splitlines()[-1])
        _nothing_secret_reached(seen, state, psutil.Process(proc.pid).children(recursive=True))
        assert (
            f"could not record the result of training_memory_bytes in {state}/results/{b}/"
            in res[2]["stderr"]
        )

        res_b = hub.run_cells(
            b,
            env_b["JUPYTERHUB_API_TOKEN"],
            [
                "from llmlab import check\nfrom llmlab.solutions import lab00\n"
                "assert check.training_memory_bytes(lab00.training_memory_bytes)"
            ],
            timeout=120,
        )
        assert res_b[0]["status"] == "ok", res_b
        table = subprocess.run(
            [sys.executable, "-m", "llmlab", "classroom", "results", "--json", str(state / "results")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        room = json.loads(table.stdout)["learners"]
        assert set(room) == {a, b}, (room, table.stderr)
        assert room[b]["training_memory_bytes"]["attempts"] == 1  # A's forged failure is not B's
        assert room[a]["training_memory_bytes"]["attempts"] == 1  # A's own passing run is A's
        assert room[a]["training_memory_bytes"]["solved"] and room[b]["training_memory_bytes"]["solved"]
    except BaseException:
        log.flush()
        lines = (certs / "hub.log").read_text().splitlines()  # shown by pytest with the failure
        print("\n".join(line for line in lines if "GET /hub/api/users/" not in line)[-8000:])
        raise
    finally:
        if proc is not None:
            _stop(proc, uids)
        log.close()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(certs, ignore_errors=True)


def _listens_on_loopback(port: int) -> None:
    bound = {
        c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port
    }
    assert bound == {"127.0.0.1"}, bound


def _nothing_secret_reached(seen: dict, state: Path, hub_tree: list) -> None:
    """What learner A's kernel saw holds none of the hub's secrets, and every door was shut."""
    secrets = {
        "instructor token": TOKEN,
        "cookie secret": (state / "jupyterhub_cookie_secret").read_text().strip(),
    }
    for p in hub_tree:  # the proxy's token, from its environment
        env = p.environ()
        if "CONFIGPROXY_AUTH_TOKEN" in env:
            secrets["proxy token"] = env["CONFIGPROXY_AUTH_TOKEN"]
    assert "proxy token" in secrets
    reached = json.dumps([seen["env"], seen["proc"]])
    for what, value in secrets.items():
        assert value and value not in reached, f"learner A can read the {what}"
    assert not [k for k in seen["env"] if k.startswith(("LLMLAB_HUB_", "CONFIGPROXY"))], seen["env"]
    assert seen["opened"] == [], seen["opened"]
    assert set(seen["denied"]) >= {
        "list state",
        "jupyterhub.sqlite",
        "jupyterhub_cookie_secret",
        "list b home",
        "read b notebook",
        "list results",
        "squat results",
        "link in results",
        "write b record",
        "link in b folder",
    }, seen["denied"]
    assert seen["b server"] == 403
    assert seen["uid"] != 0 and seen["home mode"] == "0o700"
    assert seen["kernel channels"] == ["ipc", "0o700"], seen["kernel channels"]


def _wait_up(hub: Hub, port: int, proc, log: Path) -> None:
    deadline = time.monotonic() + 120  # the hub imports torch (llmlab doctor's inventory)
    while not (_up(port) and hub.api("GET", "/hub/api/")[0] == 200):
        assert proc.poll() is None, "the hub exited:\n" + log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the hub did not answer in 120 s"
        time.sleep(0.3)


def test_demo_room_on_loopback_with_its_required_password(tmp_path):
    """Demo mode (one machine, no isolation): the shared password it requires logs a learner in,
    a wrong one does not; the learner's server starts, with its own results folder."""
    port, hub_port, api_port = _free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMLAB_")}
    password = uuid.uuid4().hex[:12]
    env.update(
        {
            "PATH": os.pathsep.join([_chp_dir(), os.environ["PATH"]]),
            "PYTHONPATH": str(ROOT),
            "LLMLAB_HUB_MODE": "demo",
            "LLMLAB_HUB_PASSWORD": password,
            "LLMLAB_HUB_STATE_DIR": str(tmp_path),
            "LLMLAB_HUB_PORT": str(port),
            "LLMLAB_HUB_API_PORT": str(hub_port),
            "LLMLAB_HUB_PROXY_API_PORT": str(api_port),
            "LLMLAB_HUB_API_TOKEN": TOKEN,
            "LLMLAB_HUB_CORES_PER_LEARNER": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    log_path = tmp_path.parent / f"{tmp_path.name}-hub.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        hub = Hub(f"http://127.0.0.1:{port}")
        try:
            _wait_up(hub, port, proc, log_path)
            _listens_on_loopback(port)
            assert not hub.log_in("dora", "wrong-password")
            assert hub.log_in("dora", password)
            status, body = hub.api("POST", "/hub/api/users/dora/server")
            assert status in (201, 202), body
            hub.wait_ready("dora", proc, time.monotonic() + 120)
            assert (tmp_path / "results" / "dora").is_dir() and (tmp_path / "home" / "dora" / "labs").is_dir()
        except BaseException:
            log.flush()
            print(log_path.read_text()[-6000:])
            raise
        finally:
            _stop(proc, [])
            log_path.unlink()


def _up(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0
