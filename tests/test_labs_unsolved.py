"""A learner's Run All: a lab executes to its end with every exercise still the stub.

CI runs every lab with ``LLMLAB_SOLUTIONS=1`` (nbval); this test runs lab 00 once without it, as a
learner meets it: each exercise check prints ✗ with the stub message, the cells after it use
llmlab's reference, and no cell raises.
"""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from llmlab.exercises import LAB_OF

ROOT = Path(__file__).resolve().parents[1]


def test_lab00_runs_to_its_end_with_every_exercise_unsolved(monkeypatch):
    monkeypatch.setenv("LLMLAB_SOLUTIONS", "0")  # the kernel inherits this environment
    monkeypatch.delenv("LLMLAB_STRICT", raising=False)
    nb = nbformat.read(ROOT / "labs" / "00_three_walls.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "labs")}}
    ).execute()  # raises on a cell error
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)  # every cell ran
    printed = "".join(o.get("text", "") for c in code for o in c.outputs)
    names = sorted(n for n, lab in LAB_OF.items() if lab == "00")
    assert len(names) == 3
    for name in names:
        assert f"✗ {name}: the function is still the stub" in printed
        assert f"exercises.reveal('{name}')" in printed
