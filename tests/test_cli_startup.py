"""``llmlab --version`` and ``llmlab --help`` answer without importing torch (about 2 s on a laptop):
``llmlab/__init__.py`` imports its top-level names on first use, and the CLI builds only the flags
of the subcommand it is given. Each runs in a fresh interpreter, which then reports whether torch
was imported."""

import subprocess
import sys

import pytest

PROBE = """
import sys
from llmlab.cli import main
try:
    code = main({argv!r})
except SystemExit as e:
    code = e.code
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code)
"""


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], ["bench", "--help"], ["train", "--help"], ["plan", "--help"]]
)
def test_version_and_help_do_not_import_torch(argv):
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    *text, verdict = out.stdout.strip().splitlines()
    assert verdict == "NO-TORCH 0", out.stdout
    if argv == ["--version"]:
        assert text[0].startswith("llmlab ")
    else:
        assert "usage: llmlab" in "\n".join(text)


def test_a_subcommand_still_gets_its_flags():
    out = subprocess.run(
        [sys.executable, "-m", "llmlab", "estimate", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "--params" in out.stdout


def test_the_package_names_are_still_there():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import llmlab, sys; t = 'torch' in sys.modules; "
            "from llmlab import launch, TrainConfig, Mesh; import llmlab as L; "
            "print(t, L.inference.LLM.__name__, sorted(set(L.__all__) - set(dir(L))))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "LLM", "[]"]


def test_classroom_results_does_not_import_torch(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=["classroom", "results", str(tmp_path)])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == [f"no results in {tmp_path} yet", "NO-TORCH 0"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--seed", str(2**64)], "--seed must be an integer in [0, 2**32)"),
        (["train", "--lr", "nan"], "--lr must be a finite number, got nan"),
        (["plan", "--params", "8e9", "--peak-tflops", "0"], "--peak-tflops must be > 0"),
        (["estimate", "--params", "8e9", "--tokens", "-1"], "--tokens must be > 0"),
    ],
)
def test_an_argument_error_is_reported_before_torch_is_imported(argv, message):
    """A bad flag is refused in a fraction of a second: the check runs before torch is imported."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip().splitlines()[-1] == "NO-TORCH 2", (out.stdout, out.stderr)
    assert f"llmlab {argv[0]}: error: {message}" in out.stderr
