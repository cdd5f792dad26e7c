"""Composed layouts (DP x TP x PP, ZeRO, mixed precision) give the single-rank losses; checkpoints
move between layouts; a killed rank stops the job, named, and --resume continues."""

import shutil

import pytest

import llmlab
from llmlab.runtime.launch import RankError
from llmlab.training.config import TrainConfig

KW = dict(seed=2, global_batch_size=8, seq_len=32)


def _losses(m):
    return {s["step"]: s["loss"] for s in m["steps"]}


def _gap(a, b):
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in a)


@pytest.fixture(scope="module")
def one_rank():
    return _losses(llmlab.train(TrainConfig(steps=4, **KW), progress=False))


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=2, tp=2),
        dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2),
        dict(dp=2, pp=2, num_microbatches=2, pp_schedule="gpipe"),
        dict(dp=2, tp=2, pp=2, num_microbatches=2),  # 8 ranks
    ],
    ids=["dp2xtp2", "tp2xpp2+sp", "dp2xpp2", "dp2xtp2xpp2"],
)
def test_composed_layout_equals_one_rank(layout, one_rank):
    m = llmlab.train(TrainConfig(steps=4, **KW, **layout), progress=False)
    assert _gap(_losses(m), one_rank) < 1e-4
    ranks = m["ranks"]
    assert len(ranks) == m["config"]["world_size"]
    # every rank of a model-parallel layout holds less than the whole model (fp32: 4 bytes each)
    largest = max(r["memory_bytes"]["params"] for r in ranks)
    if layout.get("tp", 1) * layout.get("pp", 1) > 1:
        assert largest < 4 * llmlab.get_preset("tiny").num_parameters()


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=2, pp=2, zero=1, num_microbatches=2),
        dict(dp=2, zero=2, dtype="bf16"),
    ],
    ids=["dp2xpp2+zero1", "dp2+zero2+bf16"],
)
def test_zero_in_composed_layouts(layout, one_rank):
    m = llmlab.train(TrainConfig(steps=4, **KW, **layout), progress=False)
    tol = 1e-4 if layout.get("dtype", "fp32") == "fp32" else 2e-2
    assert _gap(_losses(m), one_rank) < tol


def test_experts_over_ep_with_tensor_parallel_dense_layers():
    moe = dict(KW, model="tiny-moe")
    ref = _losses(llmlab.train(TrainConfig(steps=3, **moe), progress=False))
    m = llmlab.train(TrainConfig(steps=3, dp=2, ep=2, tp=2, **moe), progress=False)  # 4 ranks
    assert _gap(_losses(m), ref) < 1e-4
    assert {r["coords"]["ep"] for r in m["ranks"]} == {0, 1}
    assert all(r["comm_bytes"]["all_to_all"] > 0 for r in m["ranks"])


def test_checkpoint_saved_at_dp2xtp2_resumes_at_tp4_and_on_one_rank(tmp_path, one_rank):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        llmlab.train(TrainConfig(steps=2, dp=2, tp=2, checkpoint_dir=str(d), **KW), progress=False)
    tp4 = _losses(
        llmlab.train(TrainConfig(steps=4, tp=4, checkpoint_dir=str(a), resume=True, **KW), progress=False)
    )
    single = _losses(
        llmlab.train(TrainConfig(steps=4, checkpoint_dir=str(b), resume=True, **KW), progress=False)
    )
    assert sorted(tp4) == sorted(single) == [3, 4]
    assert _gap(tp4, one_rank) < 1e-4 and _gap(single, one_rank) < 1e-4


def test_killed_rank_stops_the_job_and_resume_continues(tmp_path, monkeypatch, one_rank):
    monkeypatch.setenv("LLMLAB_KILL_RANK_AT_STEP", "1:4")
    with pytest.raises(RankError) as info:
        llmlab.train(
            TrainConfig(steps=4, dp=2, checkpoint_dir=str(tmp_path), checkpoint_every=1, **KW), progress=False
        )
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    shutil.rmtree(info.value.log_dir)  # the failed job's logs, kept for reading
    monkeypatch.delenv("LLMLAB_KILL_RANK_AT_STEP")
    resumed = _losses(
        llmlab.train(
            TrainConfig(steps=4, dp=2, checkpoint_dir=str(tmp_path), resume=True, **KW), progress=False
        )
    )
    assert sorted(resumed) == [4]
    assert _gap(resumed, one_rank) < 1e-4


def test_torchrun_starts_the_ranks_and_llmlab_train_joins_them(tmp_path, one_rank):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "m.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "-m",
            "llmlab",
            "train",
            "--dp",
            "2",
            "--tp",
            "2",
            "--steps",
            "4",
            "--seed",
            "2",
            "--global-batch-size",
            "8",
            "--seq-len",
            "32",
            "--no-progress",
            "--metrics-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(out.read_text())
    assert m["config"]["world_size"] == 4 and len(m["ranks"]) == 4
    assert _gap(_losses(m), one_rank) < 1e-4
    assert proc.stdout.count("step 1:") == 1  # one summary line, from rank 0
