"""The layering of docs/ARCHITECTURE.md, checked on every import statement in llmlab/."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "llmlab"
BOTTOM = {"runtime", "metrics", "kernels", "formulas", "data"}
# package -> the llmlab packages it may import (besides itself); packages not listed are on top.
ALLOWED = {p: BOTTOM for p in BOTTOM} | {
    "formulas": set(),
    "model": BOTTOM,
    "parallel": BOTTOM | {"model"},
    "training": BOTTOM | {"model", "parallel"},
    "inference": BOTTOM | {"model", "parallel"},
}


def _imports(path: Path):
    """(line, imported llmlab package) for every import in the file, including local ones."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = ([f"llmlab.{a.name}" for a in node.names] if node.module == "llmlab"
                     else [node.module])
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "llmlab" and len(parts) > 1:
                yield node.lineno, parts[1]
            elif parts[0] == "torch":
                yield node.lineno, "torch"


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _violations():
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        pkg = _package(path)
        if pkg not in ALLOWED:
            continue
        for line, imported in _imports(path):
            if imported == "torch":
                if pkg == "formulas":
                    out.append(f"{path.relative_to(ROOT.parent)}:{line} imports torch")
            elif imported != pkg and imported not in ALLOWED[pkg]:
                out.append(f"{path.relative_to(ROOT.parent)}:{line} ({pkg}) imports llmlab.{imported}")
    return out


def test_imports_point_down():
    assert _violations() == []


@pytest.mark.parametrize("pkg", ["parallel", "model", "runtime"])
def test_no_strategy_model_or_runtime_module_imports_training(pkg):
    offenders = [f"{p}:{line}" for p in (ROOT / pkg).rglob("*.py")
                 for line, imported in _imports(p) if imported == "training"]
    assert offenders == []


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule can fail: a parallel/ module importing training is reported."""
    fake = tmp_path / "llmlab"
    (fake / "parallel").mkdir(parents=True)
    (fake / "parallel" / "probe.py").write_text("def f():\n    from llmlab.training.trainer import train\n")
    (fake / "formulas").mkdir()
    (fake / "formulas" / "x.py").write_text("import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert sorted(_violations()) == ["llmlab/formulas/x.py:1 imports torch",
                                     "llmlab/parallel/probe.py:2 (parallel) imports llmlab.training"]
