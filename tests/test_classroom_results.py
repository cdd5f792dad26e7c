"""Exercise results for the instructor: each check's outcome in a learner's JSON file (opt-in with
LLMLAB_RESULTS_DIR), and ``llmlab classroom results DIR`` aggregating a room into a table."""
import json
import subprocess
import sys

from llmlab import check
from llmlab.solutions.lab00 import ring_all_reduce_seconds, training_memory_bytes


def _wrong(num_params, bytes_per_param=4, optimizer_states=2):
    return {"params": num_params, "grads": num_params, "optimizer_states": num_params}


def test_checks_write_nothing_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMLAB_RESULTS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert check.training_memory_bytes(training_memory_bytes) is True
    assert list(tmp_path.iterdir()) == []


def test_a_room_of_results_becomes_a_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMLAB_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("LLMLAB_SOLUTIONS", "0")   # a learner's Run All: a failed check returns False
    monkeypatch.setenv("LLMLAB_STRICT", "0")
    monkeypatch.setenv("LLMLAB_LEARNER", "alice")
    assert check.training_memory_bytes(_wrong) is False
    assert check.training_memory_bytes(training_memory_bytes) is True
    assert check.ring_all_reduce_seconds(ring_all_reduce_seconds) is True
    monkeypatch.setenv("LLMLAB_LEARNER", "bob")
    for _ in range(3):
        assert check.training_memory_bytes(_wrong) is False
    capsys.readouterr()

    alice = json.loads((tmp_path / "alice.json").read_text())
    row = alice["exercises"]["training_memory_bytes"]
    assert (row["solved"], row["attempts"], row["last_ok"], row["message"]) == (True, 2, True, "")
    bob = json.loads((tmp_path / "bob.json").read_text())["exercises"]["training_memory_bytes"]
    assert (bob["solved"], bob["attempts"], bob["first_solved"]) == (False, 3, None)
    assert bob["message"].startswith("training_memory_bytes: params for 1 parameters")

    (tmp_path / "notes.json").write_text("[1, 2]")  # not a results file: named and skipped
    out = subprocess.run([sys.executable, "-m", "llmlab", "classroom", "results", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "skipping notes.json" in out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["learner", "training_memory_bytes", "ring_all_reduce_seconds"]
    assert lines[2].split() == ["alice", "ok/2", "ok"]
    assert lines[3].split() == ["bob", "x3", "."]
    assert lines[5].split() == ["solved", "(of", "2)", "1", "1"]

    js = subprocess.run([sys.executable, "-m", "llmlab", "classroom", "results", "--json", str(tmp_path)],
                        capture_output=True, text=True, timeout=60)
    room = json.loads(js.stdout)
    assert room["learners"]["bob"]["training_memory_bytes"]["attempts"] == 3
    missing = subprocess.run([sys.executable, "-m", "llmlab", "classroom", "results", str(tmp_path / "no")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no results directory" in missing.stderr
