# JupyterHub for an llmlab classroom: one node, a Jupyter server per learner, the node's GPUs and
# CPU cores shared out so that no two learners share a device. docs/workshop.md, section 3, is the guide.
#
#   cd /srv/llmlab-hub       # the folder that keeps the hub's state; hub.env: the room's LLMLAB_HUB_*, 0600
#   sudo sh -c 'set -a; . ./hub.env; exec jupyterhub -f /opt/llmlab-src/classroom/jupyterhub_config.py'
#
# Everything a room changes is an environment variable read below (LLMLAB_HUB_*); the rest follows
# the JupyterHub documentation's recommendations (an idle culler, per-user limits, a server limit,
# secrets kept from the learners, scoped tokens, TLS).
import os
import sys
from pathlib import Path

from jupyterhub.app import JupyterHub

from llmlab.classroom.isolation import (bind_error, folder_name, learner_account, private_home,
                                       results_folder, unreachable)

c = get_config()  # noqa: F821  (JupyterHub's config loader defines it)

REPO = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("LLMLAB_HUB_STATE_DIR", os.getcwd())).resolve()


def _env_int(name):
    v = os.environ.get(name)
    return int(v) if v else None


def refuse(why):
    """Stop the hub before it listens, with one line saying why (no traceback)."""
    print(f"llmlab classroom: refusing to start: {why}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# --- who logs in, and how their server is started ---------------------------------------------------
# "system" (default, the isolated room): learners are Unix accounts of the node (PAM login, or made by
# the hub with LLMLAB_HUB_CREATE_USERS=1), each server runs as its learner (LocalProcessSpawner; the
# hub runs as root), never as root or a system account, in a private (0700) home. "demo": any name
# logs in with the shared password LLMLAB_HUB_PASSWORD and every server runs as the hub's own user
# with its home under STATE/home: no isolation at all (a learner's code can read the hub's secrets),
# so demo mode listens on loopback only (one machine's own browser, an SSH tunnel, a test).
MODE = os.environ.get("LLMLAB_HUB_MODE", "system")
ROOT = os.geteuid() == 0
if MODE == "demo":
    PASSWORD = os.environ.pop("LLMLAB_HUB_PASSWORD", "")
    if len(PASSWORD) < 8:
        refuse("demo mode needs the room's shared password in LLMLAB_HUB_PASSWORD, at least 8 characters "
               f"({'unset' if not PASSWORD else f'{len(PASSWORD)} given'}), e.g. "
               "LLMLAB_HUB_PASSWORD=$(openssl rand -base64 9)")
    c.JupyterHub.authenticator_class = "shared-password"
    c.SharedPasswordAuthenticator.user_password = PASSWORD
    c.JupyterHub.spawner_class = "simple"
    c.SimpleLocalProcessSpawner.home_dir_template = str(STATE / "home" / "{username}")
    if ROOT:                           # a hub run as root (a container) runs the servers as root too
        c.Spawner.args = ["--allow-root"]
elif MODE == "system":
    if not ROOT:
        refuse("the isolated room (LLMLAB_HUB_MODE=system) runs each learner's server as that learner, "
               "so the hub must run as root (sudo -E jupyterhub ...)")
    c.JupyterHub.authenticator_class = "pam"
    c.JupyterHub.spawner_class = "localprocess"
    c.LocalAuthenticator.create_system_users = os.environ.get("LLMLAB_HUB_CREATE_USERS", "0") == "1"
    c.Authenticator.blocked_users = {"root"}
    # Kernels talk to their server over Unix sockets in the learner's 0700 runtime folder, not over
    # TCP ports on 127.0.0.1 where another learner could subscribe to a kernel's output stream.
    c.Spawner.args = ["--KernelManager.transport=ipc"]
else:
    refuse(f"LLMLAB_HUB_MODE must be 'system' or 'demo', got {MODE!r}")
c.Authenticator.allow_all = True       # every account that authenticates is a learner (system: node accounts)
c.Authenticator.admin_users = set(filter(None, os.environ.get("LLMLAB_HUB_ADMINS", "").split(",")))

# --- where the room listens: an explicit address, TLS beyond loopback --------------------------------
APP = JupyterHub.instance()            # the hub loading this file; its command line is parsed already
if {"ip", "port", "bind_url"} & set(APP.cli_config.get("JupyterHub", {})):
    refuse("give the hub's address as LLMLAB_HUB_IP / LLMLAB_HUB_PORT, not --ip/--port/--bind_url, "
           "so that this recipe can check it")
HOST = os.environ.get("LLMLAB_HUB_IP", "127.0.0.1")
PORT = _env_int("LLMLAB_HUB_PORT") or 8000
CERT, KEY = os.environ.get("LLMLAB_HUB_SSL_CERT", ""), os.environ.get("LLMLAB_HUB_SSL_KEY", "")
if bool(CERT) != bool(KEY):
    refuse("TLS needs both LLMLAB_HUB_SSL_CERT and LLMLAB_HUB_SSL_KEY")
if why := bind_error(MODE, HOST, tls=bool(CERT)):
    refuse(why)
if CERT:
    c.JupyterHub.ssl_cert, c.JupyterHub.ssl_key = CERT, KEY
c.JupyterHub.bind_url = f"{'https' if CERT else 'http'}://{f'[{HOST}]' if ':' in HOST else HOST}:{PORT}"
c.JupyterHub.hub_ip = "127.0.0.1"      # the hub's own API and the proxy's API: this node only
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{_env_int('LLMLAB_HUB_PROXY_API_PORT') or 8001}"
if _env_int("LLMLAB_HUB_API_PORT"):
    c.JupyterHub.hub_port = _env_int("LLMLAB_HUB_API_PORT")

# --- what the learners' servers get: this Python, the labs, and no secret ----------------------------
# The learner's server: this Python (the environment llmlab is installed in, whose kernel is the
# labs' kernel), pinned to the learner's cores, with the labs copied to ~/labs on first start. It
# inherits only the variables below from the hub (never LLMLAB_HUB_*, CONFIGPROXY_AUTH_TOKEN or
# LLMLAB_SECRET), plus its own JUPYTERHUB_API_TOKEN, which reaches only its own server.
c.Spawner.cmd = [sys.executable, "-m", "llmlab.classroom.singleuser"]
c.Spawner.default_url = "/lab/tree/labs/00_three_walls.ipynb"
c.Spawner.notebook_dir = "~"
c.Spawner.start_timeout = 120          # seconds; a server importing JupyterLab on a busy node is slow
c.Spawner.http_timeout = 120
c.Spawner.env_keep = ["JUPYTERHUB_SINGLEUSER_APP", "LANG", "LC_ALL", "PYTHONPATH", "LLMLAB_SOLUTIONS",
                      "LLMLAB_DEVICE", "LLMLAB_KERNELS", "LLMLAB_LIVE", "LLMLAB_PG_TIMEOUT", "TRITON_INTERPRET"]
LABS = os.environ.get("LLMLAB_HUB_LABS_SOURCE", str(REPO / "labs"))
for path in (sys.executable, LABS):
    if MODE == "system" and unreachable(path):
        refuse(f"learners' servers run {path} as the learners, but {unreachable(path)} is closed to "
               f"other accounts: install llmlab in an environment every account can read "
               f"(e.g. python -m venv /opt/llmlab)")

# --- the hub's state: its database and cookie secret are root's alone ----------------------------------
# STATE is 0711 (learners pass through to results/ but cannot list it), the database, its journal,
# the cookie secret and the proxy's pid file 0600 (the hub's umask); results/ is 0711 too, and the hub
# makes each learner's folder in it (theirs, 0700) before their server starts: nobody can create,
# squat or replace another learner's record (llmlab.check.results, llmlab.classroom.results).
os.umask(0o077)
STATE.mkdir(parents=True, exist_ok=True)
STATE.chmod(0o711 if MODE == "system" else 0o700)
RESULTS = Path(os.environ.get("LLMLAB_HUB_RESULTS_DIR", STATE / "results"))
RESULTS.mkdir(parents=True, exist_ok=True)
RESULTS.chmod(0o711)
DB = STATE / "jupyterhub.sqlite"
os.close(os.open(DB, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
DB.chmod(0o600)                        # also an older hub's 0644 database
c.JupyterHub.db_url = f"sqlite:///{DB}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
c.Spawner.environment = {
    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.defpath]),
    "LLMLAB_LABS_SOURCE": LABS,
    "LLMLAB_RESULTS_DIR": str(RESULTS),  # every exercise check is recorded: llmlab classroom results DIR
}


def learner_setup(spawner):
    """Before a learner's server starts: their account (never root), a private home, their own
    results folder."""
    name = spawner.user.name
    if MODE == "system":
        pw = learner_account(name)
        private_home(pw)
        results_folder(RESULTS, folder_name(name), pw.pw_uid, pw.pw_gid)
    else:
        results_folder(RESULTS, folder_name(name), os.geteuid(), os.getegid())


# --- sharing the node: seats from llmlab doctor's inventory and the labs' sizes ----------------------
from llmlab.classroom.seats import SeatAllocator, node_inventory, plan_room  # noqa: E402  (imports torch)

TAUGHT = [s for s in os.environ.get("LLMLAB_HUB_LABS", "").split(",") if s] or None
PLAN = plan_room(node_inventory(), labs=TAUGHT,
                 gpus_per_learner=_env_int("LLMLAB_HUB_GPUS_PER_LEARNER"),
                 cores_per_learner=_env_int("LLMLAB_HUB_CORES_PER_LEARNER"))
SEATS = SeatAllocator(PLAN)
print(f"llmlab classroom: {PLAN.describe()}", file=sys.stderr)


def take_seat(spawner):
    """pre_spawn_hook: give the learner a free seat (its GPUs, cores and RAM share), or refuse."""
    seat = SEATS.take(spawner.user.name)
    spawner.environment = {**spawner.environment, **seat.environment(PLAN.node_gpus > 0)}
    spawner.mem_limit = seat.mem_bytes or None
    spawner.cpu_limit = float(len(seat.cores))
    spawner.log.info("llmlab classroom: %s gets seat %d (GPUs %s, cores %s)", spawner.user.name,
                     seat.index, ",".join(seat.gpus) or "none", ",".join(map(str, seat.cores)))


def free_seat(spawner):
    """post_stop_hook: the seat is free again."""
    SEATS.release(spawner.user.name)


def pre_spawn(spawner):
    """pre_spawn_hook: the learner's account, home and results folder, then a seat."""
    learner_setup(spawner)
    take_seat(spawner)


c.Spawner.pre_spawn_hook = pre_spawn
c.Spawner.post_stop_hook = free_seat

# --- limits (JupyterHub docs: resource limits, "active_server_limit") -------------------------------
# mem_limit / cpu_limit are set per seat above; LocalProcessSpawner only passes them on as MEM_LIMIT /
# CPU_LIMIT (enforced by systemdspawner or a container spawner); the cores are enforced by the pinning.
c.JupyterHub.active_server_limit = PLAN.learners  # never more servers than seats
c.JupyterHub.concurrent_spawn_limit = max(2, PLAN.learners)
c.JupyterHub.allow_named_servers = False          # one server, one seat per learner
c.JupyterHub.cleanup_servers = True               # stopping the hub stops the servers: seats start free

# --- the services: the idle culler, and the instructor's API token -----------------------------------
IDLE = os.environ.get("LLMLAB_HUB_IDLE_TIMEOUT", "3600")  # seconds without activity before a server stops
c.JupyterHub.services = [{"name": "idle-culler",
                          "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={IDLE}",
                                      "--cull-every=300"]}]
c.JupyterHub.load_roles = [{"name": "idle-culler", "services": ["idle-culler"],
                            "scopes": ["list:users", "read:users:activity", "read:servers",
                                       "delete:servers"]}]
# The instructor's REST API token (scripts, tests): what the room needs and no more. It adds and
# removes learners (admin:users; their Unix accounts too with LLMLAB_HUB_CREATE_USERS=1), lists them
# and starts and stops their servers (servers). It cannot enter a learner's server (no
# access:servers), make tokens for learners (no tokens) or change roles. It is read here and removed
# from the hub's environment, so neither the proxy nor a service inherits it.
TOKEN = os.environ.pop("LLMLAB_HUB_API_TOKEN", "")
if TOKEN:
    if len(TOKEN) < 8:
        refuse(f"LLMLAB_HUB_API_TOKEN must be at least 8 characters ({len(TOKEN)} given), "
               f"e.g. LLMLAB_HUB_API_TOKEN=$(openssl rand -hex 32)")
    c.JupyterHub.services.append({"name": "instructor", "api_token": TOKEN})
    c.JupyterHub.load_roles.append({"name": "instructor", "services": ["instructor"],
                                    "scopes": ["admin:users", "servers"]})
