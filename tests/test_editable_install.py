"""A learner clones into ``~/llmlab``, runs ``pip install -e ~/llmlab`` and works in ``~``.

From ``~`` the clone folder is a directory named ``llmlab`` without ``__init__.py`` on ``sys.path``
(the script's folder or the current directory comes first), which Python imports as an empty
namespace package unless a regular ``llmlab`` package is found on ``sys.path`` too. setuptools'
default editable install for a flat layout is a meta-path finder, consulted only after the path
finder has returned that namespace package: ``import llmlab`` then gave an empty module. The
``package-dir = {"" = "."}`` setting in pyproject.toml makes setuptools write a plain ``.pth`` path
entry instead (its static-pth mode), and a regular package on the path beats a namespace portion.

This test runs the real thing rather than inspecting pyproject.toml: ``pip install -e`` of this
checkout into a fresh virtual environment (``--no-deps --no-build-isolation``: the environment
sees this environment's packages, so nothing is downloaded; about 5 s), then, from a folder holding
the checkout under the name ``llmlab``, ``import llmlab`` and ``python -m llmlab --version``.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_import_llmlab_from_the_folder_holding_a_clone_named_llmlab(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = str(venv / "bin" / "python")
    # The venv sees this environment's packages (pip, setuptools, torch...) through a path file named
    # to be read after the editable install's own, and installs into itself. (Not --system-site-packages:
    # under a virtual environment those would be the base interpreter's, without pip or setuptools.)
    site_dir = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    outer = [p for p in sys.path if p.endswith("-packages")]
    Path(site_dir, "zz_outer_environment.pth").write_text("\n".join(outer) + "\n")
    pip = subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(),
        cwd=tmp_path,
    )
    assert pip.returncode == 0, pip.stderr[-2000:]
    pth = [p.read_text() for p in (venv / "lib").glob("python*/site-packages/*.pth")]
    assert any(str(ROOT) in t for t in pth), f"no path entry for the checkout in the venv's .pth files: {pth}"

    home = tmp_path / "home"
    home.mkdir()
    (home / "llmlab").symlink_to(ROOT, target_is_directory=True)  # ~/llmlab, the clone
    probe = (
        "import llmlab, pathlib; "
        "print(llmlab.__file__); print(callable(llmlab.launch)); print(llmlab.__version__)"
    )
    out = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=120, env=_env(), cwd=home)
    assert out.returncode == 0, out.stderr[-2000:]
    file, has_launch, version = out.stdout.split()
    assert Path(file).resolve() == ROOT / "llmlab" / "__init__.py"
    assert has_launch == "True"
    cli = subprocess.run(
        [py, "-m", "llmlab", "--version"], capture_output=True, text=True, timeout=60, env=_env(), cwd=home
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout.strip() == f"llmlab {version}"
