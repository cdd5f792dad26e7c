# JupyterHub for an llmlab classroom: one node, a Jupyter server per learner, the node's GPUs and
# CPU cores shared out so that no two learners share a device. docs/workshop.md, section 3, is the guide.
#
#   jupyterhub -f classroom/jupyterhub_config.py          # in the folder that keeps the hub's state
#
# Everything a room changes is an environment variable read below (LLMLAB_HUB_*); the rest follows
# the JupyterHub documentation's recommendations (an idle culler, per-user limits, a server limit).
import os
import secrets
import sys
from pathlib import Path

from llmlab.classroom.seats import SeatAllocator, node_inventory, plan_room

c = get_config()  # noqa: F821  (JupyterHub's config loader defines it)

REPO = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("LLMLAB_HUB_STATE_DIR", os.getcwd())).resolve()
STATE.mkdir(parents=True, exist_ok=True)


def _env_int(name):
    v = os.environ.get(name)
    return int(v) if v else None


# --- who logs in, and how their server is started ---------------------------------------------------
# "system" (default): learners are Unix accounts of the node (PAM login), each server runs as its
# learner (LocalProcessSpawner; the hub runs as root). "demo": any name logs in with the shared
# password LLMLAB_HUB_PASSWORD, every server runs as the hub's own user with its home under
# STATE/home: no isolation between learners, for a trusted room or a test.
MODE = os.environ.get("LLMLAB_HUB_MODE", "system")
if MODE == "demo":
    c.JupyterHub.authenticator_class = "shared-password"
    c.SharedPasswordAuthenticator.user_password = (os.environ.get("LLMLAB_HUB_PASSWORD")
                                                   or secrets.token_urlsafe(12))
    c.JupyterHub.spawner_class = "simple"
    c.SimpleLocalProcessSpawner.home_dir_template = str(STATE / "home" / "{username}")
    if os.geteuid() == 0:              # a hub run as root (a container) runs the servers as root too
        c.Spawner.args = ["--allow-root"]
elif MODE == "system":
    c.JupyterHub.authenticator_class = "pam"
    c.JupyterHub.spawner_class = "localprocess"
else:
    raise ValueError(f"LLMLAB_HUB_MODE must be 'system' or 'demo', got {MODE!r}")
c.Authenticator.allow_all = True       # every account that authenticates is a learner (system: node accounts)
c.Authenticator.admin_users = set(filter(None, os.environ.get("LLMLAB_HUB_ADMINS", "").split(",")))

# The learner's server: this Python (the environment llmlab is installed in, whose kernel is the
# labs' kernel), pinned to the learner's cores, with the labs copied to ~/labs on first start.
c.Spawner.cmd = [sys.executable, "-m", "llmlab.classroom.singleuser"]
c.Spawner.default_url = "/lab/tree/labs/00_three_walls.ipynb"
c.Spawner.notebook_dir = "~"
c.Spawner.start_timeout = 120          # seconds; a server importing JupyterLab on a busy node is slow
c.Spawner.http_timeout = 120
c.Spawner.env_keep = ["JUPYTERHUB_SINGLEUSER_APP", "PYTHONPATH", "LLMLAB_SOLUTIONS", "LLMLAB_DEVICE",
                      "LLMLAB_KERNELS", "LLMLAB_LIVE", "LLMLAB_PG_TIMEOUT", "TRITON_INTERPRET"]
LABS = os.environ.get("LLMLAB_HUB_LABS_SOURCE", str(REPO / "labs"))
RESULTS = Path(os.environ.get("LLMLAB_HUB_RESULTS_DIR", STATE / "results"))
RESULTS.mkdir(parents=True, exist_ok=True)
RESULTS.chmod(0o1777)                  # each learner writes their own file (sticky: not others')
c.Spawner.environment = {
    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.defpath]),
    "LLMLAB_LABS_SOURCE": LABS,
    "LLMLAB_RESULTS_DIR": str(RESULTS),  # every exercise check is recorded: llmlab classroom results DIR
}

# --- sharing the node: seats from llmlab doctor's inventory and the labs' sizes ----------------------
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


c.Spawner.pre_spawn_hook = take_seat
c.Spawner.post_stop_hook = free_seat

# --- limits (JupyterHub docs: resource limits, "active_server_limit") -------------------------------
# mem_limit / cpu_limit are set per seat above; LocalProcessSpawner only passes them on as MEM_LIMIT /
# CPU_LIMIT (enforced by systemdspawner or a container spawner); the cores are enforced by the pinning.
c.JupyterHub.active_server_limit = PLAN.learners  # never more servers than seats
c.JupyterHub.concurrent_spawn_limit = max(2, PLAN.learners)
c.JupyterHub.allow_named_servers = False          # one server, one seat per learner
c.JupyterHub.cleanup_servers = True               # stopping the hub stops the servers: seats start free

# --- state, and the services: the idle culler, and the instructor's API token -----------------------
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
IDLE = os.environ.get("LLMLAB_HUB_IDLE_TIMEOUT", "3600")  # seconds without activity before a server stops
c.JupyterHub.services = [{"name": "idle-culler",
                          "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={IDLE}",
                                      "--cull-every=300"]}]
c.JupyterHub.load_roles = [{"name": "idle-culler", "services": ["idle-culler"],
                            "scopes": ["list:users", "read:users:activity", "read:servers",
                                       "delete:servers"]}]
TOKEN = os.environ.get("LLMLAB_HUB_API_TOKEN")  # the instructor's REST API token (scripts, tests)
if TOKEN:
    c.JupyterHub.services.append({"name": "instructor", "api_token": TOKEN})
    c.JupyterHub.load_roles.append({"name": "instructor", "services": ["instructor"],
                                    "scopes": ["admin:users", "admin:servers", "admin:server_state",
                                               "access:servers", "list:users", "read:users"]})
