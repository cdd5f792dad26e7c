"""benchmarks/asv_compare.py's verdict on stored asv results (real runs on the project's shared
2-core machine, benchmarks/asv/results/llmlab-ci): the planted +30% training step is flagged, the
same llmlab code measured at two commits is not; and the planted slowdown still applies to
today's trainer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import asv  # noqa: F401  (the observe extra, in dev: a missing asv fails here, never skips)
import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "asv" / "results" / "llmlab-ci"


def _compare_module():
    spec = importlib.util.spec_from_file_location("asv_compare", ROOT / "benchmarks" / "asv_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sha(prefix: str) -> str:
    (f,) = RESULTS.glob(f"{prefix}-*.json")
    return json.loads(f.read_text())["commit_hash"]


@pytest.mark.parametrize(
    "before,after,worse",
    [
        ("9919a505", "5d6e8ed1", True),  # 5d6e8ed1 = 9919a50 + the planted slowdown
        ("ecea8b86", "2834ebce", False),  # identical llmlab/ (2834ebc changed tests only)
    ],
)
def test_compare_flags_the_planted_slowdown_not_the_same_code(before, after, worse, capsys):
    assert _compare_module().compare(_sha(before), _sha(after), 1.25, "llmlab-ci") is worse
    assert "train.TrainStep.time_train_step" in capsys.readouterr().out


def test_planted_slowdown_applies_to_todays_trainer():
    """--plant appends PLANTED to llmlab/training/trainer.py: it must still compile there and wrap
    a method the trainer has (a patch with context lines stopped applying after a reformat)."""
    src = (ROOT / "llmlab" / "training" / "trainer.py").read_text()
    planted = _compare_module().PLANTED
    assert "class Engine" in src and "    def train_step(self" in src
    assert "Engine.train_step = _planted_slowdown(Engine.train_step)" in planted
    compile(src + planted, "trainer.py", "exec")
