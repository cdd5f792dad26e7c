"""Regenerate the README's lab figures from real runs of the notebooks.

Each lab is executed top to bottom (``nbclient``, solutions on, as CI runs them); the last figure
drawn by the cell named below is written to ``docs/figures/<lab>.png``. Nothing is drawn by hand:
the PNG is what the lab showed on this machine.

    PYTHONPATH=$PWD python benchmarks/readme_figures.py                 # every lab (~15 min on 2 CPU cores)
    PYTHONPATH=$PWD python benchmarks/readme_figures.py 03 07           # some labs
    PYTHONPATH=$PWD python benchmarks/readme_figures.py --from DIR      # figures from notebooks already executed
                                                                        # (e.g. by jupyter nbconvert --execute)
"""
from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "figures"

# lab -> text that starts the cell whose figure goes into the README
FIGURE_CELL = {
    "00_three_walls": "cfg = TrainConfig(model=size.model, steps=size.steps",
    "01_data_parallel": "def ddp_step_timeline(",
    "02_tensor_parallel": "labels = [f\"tp{tp}\"",
    "03_pipeline_parallel": "bubble_model = \"small\"",
    "04_expert_parallel": "STEPS = size.steps",
    "05_zero": "KINDS = (\"params\", \"grads\", \"optimizer_states\")",
    "06_paged_kv_cache": "arrivals = {0:",
    "07_continuous_batching": "wl = sharegpt_workload(",
    "08_3d_parallelism": "layouts = {",
    "09_kernels": "import statistics, time",
}


def figure_of(nb, start: str) -> bytes:
    """The last PNG among the outputs of the first code cell whose source starts with ``start``."""
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.lstrip().startswith(start):
            pngs = [o["data"]["image/png"] for o in cell.get("outputs", [])
                    if "data" in o and "image/png" in o["data"]]
            if not pngs:
                raise ValueError(f"the cell starting {start!r} drew no figure")
            return base64.b64decode(pngs[-1])
    raise ValueError(f"no code cell starts with {start!r}")


def main(argv=None) -> int:
    import nbformat
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("labs", nargs="*", help="lab numbers (default: all), e.g. 03 07")
    p.add_argument("--from", dest="executed", help="folder of executed notebooks (same file names)")
    args = p.parse_args(argv)
    labs = [n for n in FIGURE_CELL if not args.labs or n[:2] in args.labs]
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LLMLAB_SOLUTIONS", "1")
    os.environ.setdefault("LLMLAB_LIVE", "0")        # one final figure per plot
    if not Path("/dev/nvidia0").exists():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    for name in labs:
        if args.executed:
            nb = nbformat.read(Path(args.executed) / f"{name}.ipynb", as_version=4)
        else:
            from nbclient import NotebookClient
            nb = nbformat.read(ROOT / "labs" / f"{name}.ipynb", as_version=4)
            NotebookClient(nb, timeout=900, kernel_name="python3",
                           resources={"metadata": {"path": str(ROOT / "labs")}}).execute()
        png = figure_of(nb, FIGURE_CELL[name])
        (OUT / f"{name}.png").write_bytes(png)
        print(f"{name}: docs/figures/{name}.png ({len(png) / 1024:.0f} KiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
