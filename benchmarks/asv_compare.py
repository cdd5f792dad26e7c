"""Compare two commits with the asv suite: exit 1 when a benchmark got slower beyond ``--factor``.

    python benchmarks/asv_compare.py main HEAD                      # the quick subset
    python benchmarks/asv_compare.py A B --factor 1.25 -b "kernels|TrainStep" --machine mybox
    python benchmarks/asv_compare.py HEAD HEAD --plant              # must exit 1

Each commit is checked out into a temporary git worktree and measured by ``asv run --python=same``
with ``ASV_PYTHONPATH`` on that worktree, in interleaved rounds A, B, A, B (``--rounds``, samples
appended) (the suite itself, benchmarks/asv/, is always this checkout's, so
old commits are measured with today's workloads), results stored under
benchmarks/asv/results/<machine>/ by commit hash; then asv's own comparison table
(``asv compare --factor F``) and exit status 1 if any benchmark worsened by more than ``F``
(asv's ``continuous`` rule: ratio > F and, for timed benchmarks, outside the measured spread).
``asv continuous`` itself would build an environment per commit, i.e. reinstall torch.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/asv/ (the suite) would shadow the asv package for a script run from benchmarks/
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
QUICK = r"^(kernels\.|train\.TrainStep|profiling\.ProfilingOff\.time)"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


@contextlib.contextmanager
def checkout(sha: str):
    """A temporary git worktree of ``sha``, removed on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="llmlab-asv-"))
    tree = tmp / "tree"
    git("worktree", "add", "--detach", str(tree), sha)
    try:
        yield tree
    finally:
        git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tmp, ignore_errors=True)


def run_commit(sha: str, tree: Path, bench: str, machine: str, extra: list[str],
               append: bool) -> None:
    """``asv run`` of the checkout ``tree`` of ``sha``; ``append``: add its samples to the ones
    stored for ``sha`` (a later round) instead of replacing them."""
    # asv drops PYTHONPATH from a benchmark's environment and takes ASV_PYTHONPATH instead;
    # benchmarks/asv/__init__.py checks that llmlab is imported from ``tree``.
    env = os.environ | {"ASV_PYTHONPATH": str(tree), "LLMLAB_ASV_TREE": str(tree)}
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-m", "asv", "run", "--python=same", "--set-commit-hash", sha,
           "--machine", machine, "--bench", bench, "--show-stderr", "--record-samples", *extra]
    if append:  # without --record-samples in every round asv keeps no samples to append to
        cmd.append("--append-samples")
    print("+", " ".join(cmd), f"(ASV_PYTHONPATH={tree})", flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def run_rounds(a: str, b: str, rounds: int, bench: str, machine: str, extra: list[str]) -> None:
    """A, B, A, B, ...: each commit's samples come from every part of the run, so a change of the
    machine's load during it weighs on both alike."""
    with checkout(a) as tree_a, checkout(b) as tree_b:
        for r in range(rounds):
            for sha, tree in ((a, tree_a), (b, tree_b)):
                run_commit(sha, tree, bench, machine, extra, append=r > 0)


def resolve(rev: str) -> str:
    """``rev``'s full hash; a branch this clone has only as ``origin/<rev>`` (a fresh clone's
    ``main`` when another branch is checked out) is taken from there."""
    for name in (rev, f"origin/{rev}"):
        r = subprocess.run(["git", "rev-parse", "--verify", "-q", name + "^{commit}"], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.strip()
    raise SystemExit(f"asv_compare: {rev!r} is not a commit of this repository")


# Appended to llmlab/training/trainer.py of the planted commit: every Engine.train_step spins
# until it has used 30% more CPU time than the step itself (any commit with Engine.train_step).
PLANTED = """

# PLANTED SLOWDOWN (benchmarks/asv_compare.py --plant): +30% CPU time per training step
def _planted_slowdown(step):
    import functools
    import time

    @functools.wraps(step)
    def slower(*args, **kwargs):
        t0 = time.process_time()
        out = step(*args, **kwargs)
        dt = time.process_time() - t0
        while time.process_time() - t0 < 1.3 * dt:
            pass
        return out

    return slower


Engine.train_step = _planted_slowdown(Engine.train_step)
"""


def plant(rev: str) -> str:
    """A commit on top of ``rev`` whose training step takes 30% more CPU time (``PLANTED``);
    returns its hash. Nothing in this checkout changes."""
    tmp = Path(tempfile.mkdtemp(prefix="llmlab-asv-plant-"))
    tree = tmp / "tree"
    git("worktree", "add", "--detach", str(tree), resolve(rev))
    try:
        with open(tree / "llmlab" / "training" / "trainer.py", "a") as f:
            f.write(PLANTED)
        subprocess.run(["git", "-c", "user.name=asv", "-c", "user.email=asv@llmlab.invalid",
                        "commit", "-qam", "planted 30% slowdown of Engine.train_step"],
                       cwd=tree, check=True)
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, check=True,
                             capture_output=True, text=True).stdout.strip()
    finally:
        git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tmp, ignore_errors=True)
    return sha


def compare(a: str, b: str, factor: float, machine: str) -> bool:
    """Print asv's table for ``a`` -> ``b``; True when something worsened beyond ``factor``."""
    from asv.commands.compare import Compare
    from asv.config import Config
    conf = Config.load(str(ROOT / "asv.conf.json"))
    conf.results_dir = str(ROOT / "benchmarks" / "asv" / "results")
    worsened, _improved = Compare.print_table(conf, a, b, factor=factor, split=False,
                                              only_changed=False, sort="ratio", machine=machine,
                                              commit_names={a: a[:8], b: b[:8]})
    return bool(worsened)


def describe_machine(name: str) -> None:
    """Record ``name`` in ~/.asv-machine.json with what asv detects (os, arch, cpu, num_cpu, ram):
    ``asv machine --machine NAME --yes`` would store the name alone."""
    from asv.machine import Machine

    Machine.load(machine_name=name, **(Machine.get_defaults() | {"machine": name}))


def ensure_main_branch() -> None:
    """asv.conf.json's ``branches`` names ``main``; asv refuses to run without that local branch.
    A fresh clone with another branch checked out has only ``origin/main``: make ``main`` from it."""
    if subprocess.run(["git", "rev-parse", "--verify", "-q", "refs/heads/main"], cwd=ROOT,
                      capture_output=True).returncode:
        git("branch", "main", resolve("main"))
        print("asv_compare: created the local branch main from origin/main (asv.conf.json's branch)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", help="the reference commit (e.g. main)")
    p.add_argument("b", help="the commit to judge (e.g. HEAD)")
    p.add_argument("--factor", type=float, default=1.25,
                   help="flag a benchmark whose time grew by more than this ratio (default 1.25: "
                        "above the spread measured on a shared 2-core machine, docs/profiling.md)")
    p.add_argument("-b", "--bench", default=QUICK, help="benchmark regex (default: the quick subset)")
    p.add_argument("--machine", default="llmlab-ci", help="asv machine name for the results")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved rounds A, B, A, B, ... (samples appended; default 2)")
    p.add_argument("--skip-run", action="store_true", help="only compare stored results")
    p.add_argument("--plant", action="store_true",
                   help="judge B with a planted slowdown (PLANTED: +30%% CPU time per "
                        "training step): shows the check fails as it should")
    args = p.parse_args(argv)
    extra: list[str] = []
    describe_machine(args.machine)
    ensure_main_branch()
    a, b = resolve(args.a), resolve(args.b)
    if not args.skip_run:
        b = plant(b) if args.plant else b
        run_rounds(a, b, args.rounds, args.bench, args.machine, extra)
    worse = compare(a, b, args.factor, args.machine)
    print(f"{'SLOWER' if worse else 'ok'}: {args.b} vs {args.a} at --factor {args.factor}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
