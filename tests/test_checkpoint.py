"""Checkpoints: exact resume, keep-last-3, atomic writes, corruption detected and skipped."""
import json

import pytest

import llmlab
from llmlab.training.checkpoint import CheckpointError, latest_checkpoint, verify
from llmlab.training.config import TrainConfig


def _losses(m):
    return {s["step"]: s["loss"] for s in m["steps"]}


@pytest.fixture(scope="module")
def uninterrupted():
    return _losses(llmlab.train(TrainConfig(steps=6, seed=7), progress=False))


def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path, uninterrupted):
    first = llmlab.train(TrainConfig(steps=4, seed=7, checkpoint_dir=str(tmp_path), checkpoint_every=1),
                         progress=False)
    assert _losses(first) == {k: v for k, v in uninterrupted.items() if k <= 4}
    kept = sorted(d.name for d in tmp_path.iterdir())
    assert kept == ["step_00000002", "step_00000003", "step_00000004"]  # the last 3
    meta = json.loads((tmp_path / "step_00000004" / "metadata.json").read_text())
    assert meta["step"] == 4 and meta["layout"]["dp"] == 1 and meta["loss"] == uninterrupted[4]
    assert all(f["crc32"] and f["bytes"] > 0 for f in meta["files"].values())
    resumed = llmlab.train(TrainConfig(steps=6, seed=7, checkpoint_dir=str(tmp_path), resume=True),
                           progress=False)
    got = _losses(resumed)
    assert sorted(got) == [5, 6]
    for s in (5, 6):
        assert abs(got[s] - uninterrupted[s]) <= 1e-6 * abs(uninterrupted[s])


def test_corrupted_or_unfinished_checkpoints_are_skipped(tmp_path, uninterrupted):
    llmlab.train(TrainConfig(steps=3, seed=7, checkpoint_dir=str(tmp_path), checkpoint_every=1),
                 progress=False)
    (tmp_path / "step_00000009.tmp").mkdir()  # a save that died half-way: never "latest"
    shard = next((tmp_path / "step_00000003").glob("rank*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match="truncated"):
        verify(tmp_path / "step_00000003")
    msgs = []
    path, meta = latest_checkpoint(tmp_path, log=msgs.append)
    assert path.name == "step_00000002" and meta["step"] == 2
    assert any("step_00000003" in m and "truncated" in m for m in msgs)
    shard2 = next((tmp_path / "step_00000002").glob("rank*.safetensors"))
    raw = bytearray(shard2.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, flipped bits
    shard2.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="CRC32 mismatch"):
        verify(tmp_path / "step_00000002")
    resumed = llmlab.train(TrainConfig(steps=3, seed=7, checkpoint_dir=str(tmp_path), resume=True),
                           progress=False)
    # falls back to step 1, the newest good checkpoint, and recomputes steps 2-3 exactly
    got = _losses(resumed)
    assert sorted(got) == [2, 3]
    assert all(abs(got[s] - uninterrupted[s]) <= 1e-6 * uninterrupted[s] for s in got)
