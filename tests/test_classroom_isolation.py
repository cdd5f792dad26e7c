"""What keeps a room's learners apart (llmlab.classroom.isolation), and the recipe's refusals: a demo
room beyond loopback, a room without its password, an isolated room beyond loopback without TLS, an
address the recipe cannot check. The isolated room for real: tests/test_classroom_jupyterhub.py."""

import os
import pwd
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from llmlab.classroom.isolation import (
    bind_error,
    is_loopback,
    learner_account,
    private_home,
    results_folder,
    unreachable,
)

CONFIG = Path(__file__).resolve().parents[1] / "classroom" / "jupyterhub_config.py"


def test_demo_mode_listens_on_loopback_only_and_a_room_beyond_it_needs_tls():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.1.2.3")
    assert bind_error("demo", "127.0.0.1", tls=False) is None
    assert "demo mode cannot isolate learners" in bind_error("demo", "0.0.0.0", tls=True)
    assert "every interface" in bind_error("demo", "", tls=True)
    assert "passwords in clear on 10.1.2.3" in bind_error("system", "10.1.2.3", tls=False)
    assert (
        bind_error("system", "10.1.2.3", tls=True) is None and bind_error("system", "::1", tls=False) is None
    )


def test_unreachable_names_the_closed_folder():
    with tempfile.TemporaryDirectory(dir="/tmp") as base:  # /tmp: every account passes through it
        os.chmod(base, 0o755)
        closed = Path(base) / "closed"
        (closed / "env").mkdir(parents=True)
        python = closed / "env" / "python"
        python.write_text("")
        os.chmod(closed, 0o700)  # as /root is on most machines
        assert unreachable(python) == closed
        os.chmod(closed, 0o711)
        os.chmod(python, 0o600)
        assert unreachable(python) == python
        os.chmod(python, 0o755)
        assert unreachable(python) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="changes owners of files: needs root")
def test_learner_folders_are_made_by_the_hub_and_squatters_moved_aside(tmp_path):
    with pytest.raises(PermissionError, match="never root or a system account"):
        learner_account("root")
    root = tmp_path / "results"
    root.mkdir(mode=0o711)
    os.chmod(root, 0o711)
    folder = results_folder(root, "alice", 4242, 4242)
    assert folder.stat().st_uid == 4242 and folder.stat().st_mode & 0o777 == 0o700
    (root / "bob").mkdir()
    os.chown(root / "bob", 4343, 4343)  # someone else's folder under bob's name
    (root / "carol").symlink_to("/etc")  # a link under carol's name
    for name, uid in (("bob", 4444), ("carol", 4545)):
        made = results_folder(root, name, uid, uid)
        assert not made.is_symlink() and made.stat().st_uid == uid
    moved = sorted(p.name.rsplit("-", 1)[0] for p in root.iterdir() if p.name.startswith("."))
    assert moved == [".squatted-bob", ".squatted-carol"] and pwd.getpwuid(0).pw_dir != "/etc"
    assert results_folder(root, "alice", 4242, 4242) == folder  # again: kept as is
    os.chmod(root, 0o777)
    with pytest.raises(PermissionError, match="writable by it alone"):
        results_folder(root, "dave", 4646, 4646)
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chown(home, 4242, 4242)
    private_home(pwd.struct_passwd(("alice", "x", 4242, 4242, "", str(home), "/bin/sh")))
    assert home.stat().st_mode & 0o777 == 0o700
    with pytest.raises(PermissionError, match="not a folder owned by"):
        private_home(pwd.struct_passwd(("bob", "x", 4343, 4343, "", str(home), "/bin/sh")))


def test_the_recipe_refuses_what_it_cannot_make_safe(tmp_path):
    """Each case starts JupyterHub with the recipe; it must stop before listening, with one line."""
    cases = {
        "no password": ({"LLMLAB_HUB_MODE": "demo"}, [], "needs the room's shared password"),
        "short password": (
            {"LLMLAB_HUB_MODE": "demo", "LLMLAB_HUB_PASSWORD": "abc"},
            [],
            "at least 8 characters (3 given)",
        ),
        "demo beyond loopback": (
            {"LLMLAB_HUB_MODE": "demo", "LLMLAB_HUB_PASSWORD": "long-enough", "LLMLAB_HUB_IP": "0.0.0.0"},
            [],
            "demo mode cannot isolate learners",
        ),
        "address on the command line": (
            {"LLMLAB_HUB_MODE": "demo", "LLMLAB_HUB_PASSWORD": "long-enough"},
            ["--ip=0.0.0.0"],
            "not --ip/--port/--bind_url",
        ),
    }
    if os.geteuid() == 0:
        cases["clear text beyond loopback"] = (
            {"LLMLAB_HUB_MODE": "system", "LLMLAB_HUB_IP": "0.0.0.0"},
            [],
            "passwords in clear on 0.0.0.0",
        )
    procs = {}
    for name, (extra, args, _) in cases.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMLAB_HUB")}
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG), *args],
            cwd=tmp_path,
            env={**env, **extra, "LLMLAB_HUB_STATE_DIR": str(tmp_path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    for name, p in procs.items():
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 2 and "Traceback" not in out, (name, out)
        assert out.strip().splitlines()[-1].startswith("llmlab classroom: refusing to start: "), (name, out)
        assert cases[name][2] in out, (name, out)
    assert not (tmp_path / "jupyterhub.sqlite").exists()  # nothing started
