"""--checkpoint-every-minutes beside --checkpoint-every, and what each checkpoint's metadata.json
records about the run: wall-clock time, elapsed training time (carried over a resume), hardware."""

import datetime
import json

import pytest

import llmlab
from llmlab.training.config import TrainConfig

KW = dict(seed=3, global_batch_size=8, seq_len=32)


def _meta(d):
    return json.loads((d / "metadata.json").read_text())


def test_minutes_interval_saves_by_time_and_metadata_records_time_and_hardware(tmp_path):
    # 1e-9 minutes: every step is past the interval; dp=2 so rank 0's decision is broadcast
    llmlab.train(
        TrainConfig(steps=3, dp=2, checkpoint_dir=str(tmp_path), checkpoint_every_minutes=1e-9, **KW),
        progress=False,
    )
    dirs = sorted(tmp_path.iterdir())
    assert [d.name for d in dirs] == ["step_00000001", "step_00000002", "step_00000003"]
    metas = [_meta(d) for d in dirs]
    elapsed = [m["elapsed_training_s"] for m in metas]
    assert 0 < elapsed[0] < elapsed[1] < elapsed[2]
    saved = [datetime.datetime.fromisoformat(m["saved_at"]) for m in metas]
    assert saved == sorted(saved) and all(s.tzinfo is not None for s in saved)
    assert abs(saved[2].timestamp() - metas[2]["saved_at_unix"]) < 1e-3
    hw = metas[2]["hardware"]
    assert hw["world_size"] == 2 and hw["nodes"] == 1 and hw["backend"] == "gloo"
    assert hw["device"] == "cpu" and hw["cpu_cores"] >= 1 and hw["step_time_s"] > 0
    # an hour's interval saves only after the last step; a resume carries the elapsed time on
    other = tmp_path / "hour"
    llmlab.train(
        TrainConfig(steps=2, checkpoint_dir=str(other), checkpoint_every_minutes=60, **KW), progress=False
    )
    assert [d.name for d in other.iterdir()] == ["step_00000002"]
    before = _meta(other / "step_00000002")["elapsed_training_s"]
    llmlab.train(TrainConfig(steps=3, checkpoint_dir=str(other), resume=True, **KW), progress=False)
    assert _meta(other / "step_00000003")["elapsed_training_s"] > before


@pytest.mark.parametrize(
    "kw,msg",
    [
        (
            {"checkpoint_every_minutes": -1.0, "checkpoint_dir": "x"},
            "--checkpoint-every-minutes must be >= 0",
        ),
        ({"checkpoint_every_minutes": 30.0}, "--checkpoint-every-minutes needs --checkpoint-dir"),
    ],
)
def test_bad_minutes_are_refused_before_launch(kw, msg):
    with pytest.raises(ValueError, match=msg):
        llmlab.train(TrainConfig(steps=1, **kw), progress=False)
