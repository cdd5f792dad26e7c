"""`.ci/check_extras.py`: CI stops when a package of a tested extra is missing on this platform."""

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture
def check():
    path = Path(__file__).parents[1] / ".ci" / "check_extras.py"
    spec = importlib.util.spec_from_file_location("check_extras", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_missing_or_wrong_package_of_an_included_extra_is_named(check, monkeypatch):
    reqs = [
        'pytest; extra == "dev"',
        'llmlab[kernels]; extra == "dev"',
        'surely-not-installed-llmlab-pkg>=1; extra == "kernels"',
        'pytest<1; extra == "kernels"',
        'another-missing-pkg; extra == "kernels" and python_version < "3"',  # not this platform
        'unused-missing-pkg; extra == "lab"',
    ]  # not tested
    monkeypatch.setattr(check.metadata, "requires", lambda name: reqs)
    problems = check.missing(["dev"])
    assert len(problems) == 2
    assert problems[0].startswith("surely-not-installed-llmlab-pkg>=1") and "not installed" in problems[0]
    assert problems[1].startswith("pytest<1") and "installed" in problems[1]


def test_this_environment_has_every_tested_extra(check):
    assert check.missing(["dev"]) == []


def test_no_test_skips_on_an_import():
    """Hard dependencies and the tested extras are installed (CI checks it above), so a test that
    skips when an import fails would only hide a broken installation. (The Triton tests skip on
    the platforms the kernels extra does not cover, by platform, not by import.)"""
    import re

    tests = Path(__file__).parent
    offenders = [
        f"{p.name}:{n}"
        for p in sorted(tests.glob("*.py"))
        if p.name != Path(__file__).name
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"importorskip\(", line)
    ]
    assert offenders == []
