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
    first = llmlab.train(
        TrainConfig(steps=4, seed=7, checkpoint_dir=str(tmp_path), checkpoint_every=1), progress=False
    )
    assert _losses(first) == {k: v for k, v in uninterrupted.items() if k <= 4}
    kept = sorted(d.name for d in tmp_path.iterdir())
    assert kept == ["step_00000002", "step_00000003", "step_00000004"]  # the last 3
    meta = json.loads((tmp_path / "step_00000004" / "metadata.json").read_text())
    assert meta["step"] == 4 and meta["layout"]["dp"] == 1 and meta["loss"] == uninterrupted[4]
    assert all(f["crc32"] and f["bytes"] > 0 for f in meta["files"].values())
    resumed = llmlab.train(
        TrainConfig(steps=6, seed=7, checkpoint_dir=str(tmp_path), resume=True), progress=False
    )
    got = _losses(resumed)
    assert sorted(got) == [5, 6]
    for s in (5, 6):
        assert abs(got[s] - uninterrupted[s]) <= 1e-6 * abs(uninterrupted[s])


def test_corrupted_or_unfinished_checkpoints_are_skipped(tmp_path, uninterrupted):
    llmlab.train(
        TrainConfig(steps=3, seed=7, checkpoint_dir=str(tmp_path), checkpoint_every=1), progress=False
    )
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
    resumed = llmlab.train(
        TrainConfig(steps=3, seed=7, checkpoint_dir=str(tmp_path), resume=True), progress=False
    )
    # falls back to step 1, the newest good checkpoint, and recomputes steps 2-3 exactly
    got = _losses(resumed)
    assert sorted(got) == [2, 3]
    assert all(abs(got[s] - uninterrupted[s]) <= 1e-6 * uninterrupted[s] for s in got)


RESUME = dict(seed=7, global_batch_size=4, seq_len=32)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16ckpt")
    llmlab.train(TrainConfig(steps=2, dtype="bf16", checkpoint_dir=str(d), **RESUME), progress=False)
    return d


def _resume_copy(src, dst, **kw):
    import shutil

    shutil.copytree(src, dst)
    m = llmlab.train(
        TrainConfig(steps=4, checkpoint_dir=str(dst), resume=True, **RESUME, **kw), progress=False
    )
    return [(s["loss"], s["grad_norm"]) for s in m["steps"]]


def test_a_bf16_checkpoint_resumed_in_fp32_starts_every_layout_from_the_fp32_masters(
    bf16_checkpoint, tmp_path
):
    """Resumed in fp32, the weights are the checkpoint's fp32 masters (not their bf16 rounding),
    on one rank and on every replica of DDP, TP and ZeRO-1 (whose masters cover only the rank's
    shard): the same losses and grad norms as one rank."""
    import torch
    from llmlab.training.checkpoint import _assemble, load_checkpoint
    from llmlab.runtime.mesh import Mesh
    from llmlab.training.trainer import Engine

    engine = Engine(TrainConfig(**RESUME), Mesh.build(dp=1), torch.device("cpu"))
    load_checkpoint(engine, bf16_checkpoint)
    path, meta = latest_checkpoint(bf16_checkpoint)
    full = _assemble(path, meta)
    w = dict(engine.model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    master = full["model.layers.0.mlp.up_proj.weight::master"]
    assert w.dtype == torch.float32 and torch.equal(w.detach(), master)
    assert not torch.equal(master, master.bfloat16().float())  # the masters carry more bits
    one = _resume_copy(bf16_checkpoint, tmp_path / "one", dtype="fp32")
    for name, kw in {"dp2 zero1": dict(dp=2, zero=1), "dp2": dict(dp=2), "tp2": dict(tp=2)}.items():
        got = _resume_copy(bf16_checkpoint, tmp_path / name.replace(" ", "_"), dtype="fp32", **kw)
        for (la, ga), (lb, gb) in zip(got, one):
            assert abs(la - lb) <= 1e-5 * lb and abs(ga - gb) <= 1e-4 * gb, (name, got, one)


def test_an_fp32_checkpoint_resumed_in_bf16_gets_fp32_masters(tmp_path):
    import torch
    from llmlab.training.checkpoint import load_checkpoint
    from llmlab.runtime.mesh import Mesh
    from llmlab.training.trainer import Engine

    llmlab.train(TrainConfig(steps=1, checkpoint_dir=str(tmp_path), **RESUME), progress=False)
    ref = Engine(TrainConfig(**RESUME), Mesh.build(dp=1), torch.device("cpu"))
    load_checkpoint(ref, tmp_path)
    want = [p.detach() for p in ref.model.parameters()]
    for kw in (dict(), dict(zero=1)):
        engine = Engine(TrainConfig(dtype="bf16", **RESUME, **kw), Mesh.build(dp=1), torch.device("cpu"))
        load_checkpoint(engine, tmp_path)
        if kw:
            masters = torch.cat([m.detach() for m in engine.optimizer.masters])
            flat = torch.cat([w.reshape(-1) for w in want[::-1]])  # ZeRO buckets: backward order
            assert torch.equal(masters[: flat.numel()], flat)
        else:
            assert all(torch.equal(m.detach(), w) for m, w in zip(engine.optimizer.master, want))


def test_resume_refuses_a_changed_schedule_naming_the_flag_unless_overridden(tmp_path, capsys):
    from llmlab.cli import main

    kw = dict(checkpoint_dir=str(tmp_path), **RESUME)
    llmlab.train(TrainConfig(steps=2, **kw), progress=False)
    with pytest.raises(ValueError, match="--lr-schedule is 'cosine'.*made with --lr-schedule 'constant'"):
        llmlab.train(TrainConfig(steps=3, lr_schedule="cosine", resume=True, **kw), progress=False)
    with pytest.raises(ValueError, match="--lr is 0.01"):
        llmlab.train(TrainConfig(steps=3, lr=0.01, resume=True, **kw), progress=False)
    assert (
        main(
            [
                "train",
                "--steps",
                "3",
                "--no-progress",
                "--checkpoint-dir",
                str(tmp_path),
                "--global-batch-size",
                "4",
                "--seq-len",
                "32",
                "--seed",
                "7",
                "--warmup-steps",
                "2",
                "--resume",
            ]
        )
        == 2
    )
    assert "--warmup-steps" in capsys.readouterr().err
    # a longer constant-rate run may continue; the override takes the new schedule
    m = llmlab.train(
        TrainConfig(steps=3, lr_schedule="cosine", resume=True, override_opt_param_scheduler=True, **kw),
        progress=False,
    )
    assert [s["step"] for s in m["steps"]] == [3] and m["steps"][0]["lr"] == 0.0  # cosine's end


def test_resume_refuses_a_changed_seed_batch_or_sequence_length_unless_overridden(tmp_path, capsys):
    """The data of step s depends on (seed, s, global batch size, sequence length): a resumed run
    that changes one would train on other data than the run it continues."""
    from llmlab.cli import main

    kw = dict(checkpoint_dir=str(tmp_path), **RESUME)
    llmlab.train(TrainConfig(steps=1, **kw), progress=False)
    meta = json.loads((tmp_path / "step_00000001" / "metadata.json").read_text())
    assert meta["data_flags"] == {"seed": 7, "global_batch_size": 4, "seq_len": 32}
    for flag, change in (
        ("--seed", {"seed": 8}),
        ("--global-batch-size", {"global_batch_size": 8}),
        ("--seq-len", {"seq_len": 16}),
    ):
        with pytest.raises(
            ValueError,
            match=f"{flag} is {list(change.values())[0]} but the checkpoint "
            f".* made with {flag} {RESUME[list(change)[0]]}",
        ):
            llmlab.train(TrainConfig(steps=2, resume=True, **(kw | change)), progress=False)
    assert (
        main(
            [
                "train",
                "--steps",
                "2",
                "--no-progress",
                "--checkpoint-dir",
                str(tmp_path),
                "--global-batch-size",
                "4",
                "--seq-len",
                "32",
                "--seed",
                "8",
                "--resume",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--seed is 8 but the checkpoint" in err and "--override-data-order" in err
    m = llmlab.train(
        TrainConfig(steps=2, resume=True, override_data_order=True, **(kw | {"seed": 8})), progress=False
    )
    assert [s["step"] for s in m["steps"]] == [2]
