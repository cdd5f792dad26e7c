"""The layering of docs/ARCHITECTURE.md, checked on every import statement in llmlab/: imports point
down, and the import graph (of modules, and of packages) has no cycle."""

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
            names = [f"llmlab.{a.name}" for a in node.names] if node.module == "llmlab" else [node.module]
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
    offenders = [
        f"{p}:{line}"
        for p in (ROOT / pkg).rglob("*.py")
        for line, imported in _imports(p)
        if imported == "training"
    ]
    assert offenders == []


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule can fail: a parallel/ module importing training is reported."""
    fake = tmp_path / "llmlab"
    (fake / "parallel").mkdir(parents=True)
    (fake / "parallel" / "probe.py").write_text("def f():\n    from llmlab.training.trainer import train\n")
    (fake / "formulas").mkdir()
    (fake / "formulas" / "x.py").write_text("import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert sorted(_violations()) == [
        "llmlab/formulas/x.py:1 imports torch",
        "llmlab/parallel/probe.py:2 (parallel) imports llmlab.training",
    ]


def _module_graph(root: Path) -> dict[str, set[str]]:
    """module -> the llmlab modules it imports (imports inside functions too). ``from a import b``
    names the module ``a.b`` when that is a module, else ``a``; a package's ``__init__`` is the
    package's name. Importing a submodule is not counted as importing its package's ``__init__``."""
    mods = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for mod, path in mods.items():
        graph[mod] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                    for a in node.names
                ]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """llmlab package (or top-level module) -> the others it imports."""

    def pkg(m):
        return m.split(".")[1] if "." in m else m

    out = {}
    for m, targets in graph.items():
        out.setdefault(pkg(m), set()).update(pkg(t) for t in targets if pkg(t) != pkg(m))
    return out


def test_no_import_cycle():
    """No module imports itself round a circle, and no package does (of two packages that import
    each other, one import runs back up)."""
    graph = _module_graph(ROOT)
    assert _cycles(graph) == []
    assert _cycles(_package_graph(graph)) == []


def test_the_checker_sees_an_import_cycle(tmp_path):
    """The rule can fail: two modules importing each other (one inside a function), and two
    packages importing each other, are reported."""
    fake = tmp_path / "llmlab"
    (fake / "model").mkdir(parents=True)
    (fake / "model" / "__init__.py").write_text("")
    (fake / "model" / "a.py").write_text("from llmlab.model.b import f\n")
    (fake / "model" / "b.py").write_text("def f():\n    from llmlab.model import a\n")
    (fake / "doctor.py").write_text("import llmlab.selftest.runner\n")
    (fake / "selftest").mkdir()
    (fake / "selftest" / "runner.py").write_text("from llmlab.doctor import hardware\n")
    graph = _module_graph(fake)
    assert _cycles(graph) == [
        ["llmlab.doctor", "llmlab.selftest.runner"],
        ["llmlab.model.a", "llmlab.model.b"],
    ]
    assert _cycles(_package_graph(graph)) == [["doctor", "selftest"]]


# --------------------------------------------------------------------------------------------
# Readability rules: short functions, no module reading another's private attributes
# --------------------------------------------------------------------------------------------
MAX_FUNCTION_LINES = 80


def _long_functions(root: Path) -> list[str]:
    """``path:line name (N lines)`` of every function (methods, nested ones) longer than
    :data:`MAX_FUNCTION_LINES`, counted from ``def`` to its last line."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_80_lines():
    assert _long_functions(ROOT) == []


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _owned_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: module-level and class-level ``_x`` (functions,
    classes, assignments) and every attribute ``_x`` it assigns (``obj._x = ...``)."""
    owned = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            owned.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            owned.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            owned.add(node.attr)
    return owned


def _private_reads(root: Path) -> list[str]:
    """``path:line obj._x`` where a module reads a private attribute ``_x`` of an object other
    than ``self``/``cls`` that another llmlab module defines and this one does not, or imports a
    private name from another llmlab package. Third-party private names (``os._exit``,
    ``tensor._base``) belong to no llmlab module and are not this rule's business."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(root.rglob("*.py"))}
    owned = {path: _owned_private_names(tree) for path, tree in trees.items()}
    out = []
    for path, tree in trees.items():
        others = set().union(*(o for p, o in owned.items() if p != path)) - owned[path]
        pkg = _package_of(root, path)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Load)
                and node.attr in others
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                out.append(f"{path.relative_to(root.parent)}:{node.lineno} {ast.unparse(node)}")
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                and node.module.startswith("llmlab.")
                and node.module.split(".")[1] != pkg
            ):
                out += [
                    f"{path.relative_to(root.parent)}:{node.lineno} imports {node.module}.{a.name}"
                    for a in node.names
                    if _private(a.name)
                ]
    return out


def _package_of(root: Path, path: Path) -> str:
    rel = path.relative_to(root).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def test_no_module_reads_another_modules_private_attributes():
    """A module speaks to another through its public names: no ``obj._x`` of a private attribute
    another llmlab module defines, no private name imported from another package."""
    assert _private_reads(ROOT) == []


def test_checkpoints_use_the_strategies_only_through_their_contract():
    """``training/checkpoint.py`` saves and loads sharded state through the optimizer's
    ``param_state``/``load_param_state`` pair: it imports nothing private from ``parallel/`` and
    reads no underscore attribute of any object but itself."""
    tree = ast.parse((ROOT / "training" / "checkpoint.py").read_text())
    bad = [
        f"line {n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and _private(n.attr)
        and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
    ]
    bad += [
        f"line {n.lineno}: from {n.module} import {a.name}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("llmlab.parallel")
        for a in n.names
        if _private(a.name)
    ]
    assert bad == []


def test_the_readability_checkers_see_a_long_function_and_a_private_read(tmp_path):
    """The rules can fail: an 81-line function, a module reading another's ``_x`` and importing
    a private name from another package are reported; reading its own ``_x`` and a third-party
    one (``os._exit``) are not."""
    fake = tmp_path / "llmlab"
    (fake / "parallel").mkdir(parents=True)
    (fake / "training").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    (fake / "parallel" / "zero.py").write_text(
        "class Bucket:\n    def __init__(self):\n        self._flat = 0\n\n"
        "def _gather(b):\n    return b._flat\n\n"  # its own private attribute: fine
        f"def long():\n{body}    return x0\n"
    )
    (fake / "training" / "checkpoint.py").write_text(
        "import os\nfrom llmlab.parallel.zero import _gather\n\n"
        "def save(bucket):\n    os._exit\n    return bucket._flat\n"
    )
    assert _long_functions(fake) == ["llmlab/parallel/zero.py:8 long (81 lines)"]
    assert _private_reads(fake) == [
        "llmlab/training/checkpoint.py:2 imports llmlab.parallel.zero._gather",
        "llmlab/training/checkpoint.py:6 bucket._flat",
    ]
