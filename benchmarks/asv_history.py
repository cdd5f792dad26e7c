"""The benchmark history as one figure: each benchmark's result per commit (oldest to newest),
relative to its first result, from asv's results JSON (benchmarks/asv/results/<machine>/). Left:
the quick subset (CPU time of one thread); right: the multi-rank training steps and the engine
(wall-clock seconds). Every stored commit is drawn, by commit date; a tick marked ``*`` is not on
main's first-parent line (the commits ``asv publish`` draws for branch main), ``†`` is not in
this repository (a ``--plant`` commit). ``--main-only``: only main's first-parent line.

    python benchmarks/asv_history.py --machine llmlab-ci --out docs/figures/asv_history.png

(``asv publish`` renders the same history as HTML pages, with one graph per benchmark.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK = re.compile(r"^(kernels\.|train\.TrainStep|profiling\.)")


def main_line() -> set[str]:
    """Commits of main's first-parent line (what ``asv publish`` shows for branch main)."""
    for ref in ("main", "origin/main"):  # a fresh clone of another branch has origin/main only
        r = subprocess.run(
            ["git", "rev-list", "--first-parent", ref], cwd=ROOT, capture_output=True, text=True
        )
        if r.returncode == 0:
            return set(r.stdout.split())
    return set()


def history(machine: str, keep: set[str] | None = None) -> tuple[list[str], dict[str, list[float | None]]]:
    """Commits (short hashes, by commit date) and ``{benchmark: [result or None per commit]}``
    (a parameterised benchmark: one entry per parameter value); ``keep``: only these commits."""
    runs = []
    for f in (ROOT / "benchmarks" / "asv" / "results" / machine).glob("*-*.json"):
        d = json.loads(f.read_text())
        if keep is None or d["commit_hash"] in keep:
            runs.append(d)
    runs.sort(key=lambda d: d["date"])  # asv stores the commit's date
    series: dict[str, list[float | None]] = {}
    for i, d in enumerate(runs):
        col = d["result_columns"]
        for name, row in d["results"].items():
            res, params = row[col.index("result")], row[col.index("params")]
            labels = [", ".join(p) for p in itertools.product(*params)] if params else [""]
            for label, v in zip(labels, res or []):
                key = f"{name}({label})" if label else name
                series.setdefault(key, [None] * len(runs))[i] = v
    main = main_line()
    known = set(
        subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    )

    def tick(h: str) -> str:
        return h[:8] + ("" if h in main else "†" if h not in known else "*")

    return [tick(d["commit_hash"]) for d in runs], series


def draw(ax, commits: list[str], series: dict[str, list[float | None]], title: str) -> None:
    for name, vals in sorted(series.items()):
        base = next((v for v in vals if v and v == v), None)  # not None, 0 or NaN (skipped)
        if base:
            y = [v / base if v and v == v else float("nan") for v in vals]
            ax.plot(range(len(commits)), y, "o-", label=name.split(".", 1)[1], ms=4)
    ax.axhline(1.25, color="C3", ls="--", lw=1, label="--factor 1.25")
    ax.set_xticks(range(len(commits)), commits, fontsize=7, rotation=30)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(0, -0.22), ncol=2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--machine", default="llmlab-ci")
    p.add_argument("--main-only", action="store_true", help="only commits of main's first-parent line")
    p.add_argument("--out", default=str(ROOT / "docs" / "figures" / "asv_history.png"))
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    commits, series = history(args.machine, main_line() if args.main_only else None)
    fig, axes = plt.subplots(1, 2, figsize=(10, 5.2))
    quick = {k: v for k, v in series.items() if QUICK.match(k)}
    rest = {k: v for k, v in series.items() if not QUICK.match(k)}
    draw(axes[0], commits, quick, "quick subset: CPU time, one thread")
    draw(axes[1], commits, rest, "2-rank training steps, engine: wall clock")
    axes[0].set_ylabel("result relative to the first commit")
    fig.suptitle(
        f"asv history, machine {args.machine} (*: not on main's first-parent line, †: a --plant commit)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
