"""Exercise results for the instructor: each check's outcome in the learner's own folder (opt-in with
LLMLAB_RESULTS_DIR), and ``llmlab classroom results DIR`` aggregating a room into a table that
survives hostile entries (malformed, FIFO, links to /dev/zero, oversized, foreign, control characters).
The same room with real learner accounts behind a real hub: tests/test_classroom_jupyterhub.py."""

import json
import os
import subprocess
import sys

from llmlab import check
from llmlab.classroom.isolation import MAX_BYTES, folder_name
from llmlab.classroom.results import printable
from llmlab.solutions.lab00 import ring_all_reduce_seconds, training_memory_bytes


def _wrong(num_params, bytes_per_param=4, optimizer_states=2):
    return {"params": num_params, "grads": num_params, "optimizer_states": num_params}


def _stub(num_params, bytes_per_param=4, optimizer_states=2):
    raise NotImplementedError


def _results(*args):
    return subprocess.run(
        [sys.executable, "-m", "llmlab", "classroom", "results", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_checks_write_nothing_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMLAB_RESULTS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert check.training_memory_bytes(training_memory_bytes) is True
    assert list(tmp_path.iterdir()) == []


def test_a_room_of_results_becomes_a_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMLAB_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("LLMLAB_SOLUTIONS", "0")  # a learner's Run All: a failed check returns False
    monkeypatch.setenv("LLMLAB_STRICT", "0")
    monkeypatch.setenv("LLMLAB_LEARNER", "alice")
    assert check.training_memory_bytes(_stub) is False  # untouched stub: not an attempt
    assert not (tmp_path / "alice").exists()
    assert check.training_memory_bytes(_wrong) is False
    assert check.training_memory_bytes(_stub) is False
    assert check.training_memory_bytes(training_memory_bytes) is True
    assert check.ring_all_reduce_seconds(ring_all_reduce_seconds) is True
    monkeypatch.setenv("LLMLAB_LEARNER", "bob")
    for _ in range(3):
        assert check.training_memory_bytes(_wrong) is False
    capsys.readouterr()

    assert oct((tmp_path / "alice").stat().st_mode & 0o777) == "0o700"  # the learner's own folder
    alice = json.loads((tmp_path / "alice" / "results.json").read_text())
    row = alice["exercises"]["training_memory_bytes"]
    assert (row["solved"], row["attempts"], row["last_ok"], row["message"]) == (True, 2, True, "")
    bob = json.loads((tmp_path / "bob" / "results.json").read_text())["exercises"]["training_memory_bytes"]
    assert (bob["solved"], bob["attempts"], bob["first_solved"]) == (False, 3, None)
    assert bob["message"].startswith("training_memory_bytes: params for 1 parameters")

    (tmp_path / "notes.json").write_text("[1, 2]")  # not a learner's folder: named and skipped
    out = _results(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "skipping notes.json: not a learner's folder" in out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["learner", "training_memory_bytes", "ring_all_reduce_seconds"]
    assert lines[2].split() == ["alice", "ok/2", "ok"]
    assert lines[3].split() == ["bob", "x3", "."]
    assert lines[5].split() == ["solved", "(of", "2)", "1", "1"]

    room = json.loads(_results("--json", tmp_path).stdout)
    assert room["learners"]["bob"]["training_memory_bytes"]["attempts"] == 3
    missing = _results(tmp_path / "no")
    assert missing.returncode == 2 and "no results directory" in missing.stderr


def _record(folder, exercises):
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"exercises": exercises}))


def test_the_table_survives_hostile_entries_and_escapes_names(tmp_path):
    ok = {"ring": {"solved": True, "attempts": 1, "first_solved": 1.0, "last": 1.0, "message": ""}}
    _record(tmp_path / "alice", ok)
    evil = "\x1b[2J\x1b]52;c;cm0gLXJm\x07eve"  # clear screen, clipboard write
    _record(tmp_path / evil, {"\x1b[31mred": ok["ring"]})
    (tmp_path / "mal").mkdir()
    (tmp_path / "mal" / "results.json").write_text('{"exercises": {"ring": ')  # malformed
    _record(tmp_path / "lax", {"ring": {"solved": "yes", "attempts": 1}})  # wrong types
    os.mkfifo(tmp_path / "fifo")  # a FIFO as a learner
    (tmp_path / "pipe").mkdir()
    os.mkfifo(tmp_path / "pipe" / "results.json")  # a FIFO as a record
    (tmp_path / "zero").symlink_to("/dev/zero")  # links, never followed
    (tmp_path / "zlink").mkdir()
    (tmp_path / "zlink" / "results.json").symlink_to("/dev/zero")
    (tmp_path / "alias").symlink_to(tmp_path / "alice")
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "results.json").write_text('{"exercises": {}}' + " " * MAX_BYTES)
    _record(tmp_path / "carol", ok)
    os.chown(tmp_path / "carol", 4242, 4242)  # a folder named carol that some other account owns
    _record(tmp_path / "dave", ok)
    os.chown(tmp_path / "dave" / "results.json", 4242, 4242)  # a record planted by someone else

    out = _results(tmp_path)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[2:-2]}
    assert rows == {"alice": [".", "ok"], printable(evil): ["ok", "."]}, out.stdout  # columns: red, ring
    assert "\x1b" not in out.stdout + out.stderr and "\x07" not in out.stdout + out.stderr
    assert "\\x1b[2J\\x1b]52;c;cm0gLXJm\\x07eve" in out.stdout and "\\x1b[31mred" in out.stdout
    skipped = {line.split("skipping ")[1].split(": ")[0]: line for line in out.stderr.splitlines()}
    assert set(skipped) == {"mal", "lax", "fifo", "pipe", "zero", "zlink", "alias", "big", "carol", "dave"}
    assert "a link" in skipped["zero"] and "a link" in skipped["alias"]
    assert "larger than" in skipped["big"] and "not a regular file" in skipped["pipe"]
    assert "foreign: the folder belongs to 4242, not to carol" in skipped["carol"]
    assert "foreign: results.json belongs to uid 4242" in skipped["dave"]
    js = json.loads(_results("--json", tmp_path).stdout)
    assert sorted(js["learners"]) == sorted(["alice", evil])


def test_a_record_is_never_written_through_a_link(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMLAB_RESULTS_DIR", str(tmp_path))
    notebook = tmp_path.parent / f"{tmp_path.name}-notebook.ipynb"
    notebook.write_text("precious")
    (tmp_path / "eve").symlink_to(tmp_path.parent)  # a learner folder that is a link
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / ".lock").symlink_to(notebook)  # a lock that points at a notebook
    for who in ("eve", "bob"):
        monkeypatch.setenv("LLMLAB_LEARNER", who)
        assert check.training_memory_bytes(training_memory_bytes) is True  # the check still passes
        assert "could not record the result of training_memory_bytes" in capsys.readouterr().err
    assert notebook.read_text() == "precious" and not (tmp_path / "bob" / "results.json").exists()
    notebook.unlink()
    assert folder_name("..") == "_.." and folder_name("a/b c") == "a_b_c" and folder_name("") == "_"
