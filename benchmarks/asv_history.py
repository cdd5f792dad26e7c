"""The benchmark history as one figure: each benchmark's result per commit (oldest to newest),
relative to its first commit, from asv's results JSON (benchmarks/asv/results/<machine>/).

    python benchmarks/asv_history.py --machine llmlab-ci --out docs/figures/asv_history.png

(``asv publish`` renders the same history as HTML pages, with one graph per benchmark.)
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def history(machine: str) -> tuple[list[str], dict[str, list[float | None]]]:
    """Commits (short hashes, by commit date) and ``{benchmark: [result or None per commit]}``
    (a parameterised benchmark: one entry per parameter value)."""
    runs = []
    for f in (ROOT / "benchmarks" / "asv" / "results" / machine).glob("*-*.json"):
        d = json.loads(f.read_text())
        when = subprocess.run(["git", "show", "-s", "--format=%ct", d["commit_hash"]], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        runs.append((int(when or 0), d))
    runs.sort(key=lambda r: r[0])
    series: dict[str, list[float | None]] = {}
    for i, (_, d) in enumerate(runs):
        col = d["result_columns"]
        for name, row in d["results"].items():
            res, params = row[col.index("result")], row[col.index("params")]
            labels = [", ".join(p) for p in _product(params)] if params else [""]
            for label, v in zip(labels, res or []):
                key = f"{name}({label})" if label else name
                series.setdefault(key, [None] * len(runs))[i] = v
    return [d["commit_hash"][:8] for _, d in runs], series


def _product(params: list[list[str]]) -> list[tuple[str, ...]]:
    import itertools
    return list(itertools.product(*params))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--machine", default="llmlab-ci")
    p.add_argument("--out", default=str(ROOT / "docs" / "figures" / "asv_history.png"))
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    commits, series = history(args.machine)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, vals in sorted(series.items()):
        base = next((v for v in vals if v), None)
        if base:
            ax.plot(range(len(commits)), [v / base if v else float("nan") for v in vals], "o-",
                    label=name.split(".", 1)[1], ms=4)
    ax.axhline(1.25, color="C3", ls="--", lw=1, label="--factor 1.25")
    ax.set_xticks(range(len(commits)), commits, fontsize=8)
    ax.set_ylabel("time relative to the first commit")
    ax.set_title(f"asv history, machine {args.machine}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
