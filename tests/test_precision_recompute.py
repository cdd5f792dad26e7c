"""Mixed precision (fp32 master weights, loss scaling) and activation checkpointing."""

import math

import pytest
import torch

import llmlab
from llmlab.model.config import get_preset
from llmlab.training.config import TrainConfig
from llmlab.training.precision import DynamicLossScaler, MixedPrecisionOptimizer, relative_gap


@pytest.fixture(scope="module")
def fp32():
    return llmlab.train(TrainConfig(steps=6, seed=3), progress=False)


def _losses(m):
    return [s["loss"] for s in m["steps"]]


def test_bf16_uses_2_2_12_bytes_per_parameter_and_tracks_fp32(fp32):
    m = llmlab.train(TrainConfig(steps=6, seed=3, dtype="bf16"), progress=False)
    mem = m["ranks"][0]["memory_bytes"]
    cfg = get_preset("tiny")
    psi, n_tensors = cfg.num_parameters(), 2 + 9 * cfg.num_hidden_layers + 1
    assert mem["params"] == 2 * psi and mem["grads"] == 2 * psi
    assert mem["optimizer_states"] == 12 * psi + 4 * n_tensors  # fp32 master + m + v (+ step)
    gap = relative_gap(_losses(m), _losses(fp32))
    assert 0 < gap < 0.02, gap  # bf16 is not bit-identical, but close over 6 steps


def test_fp16_loss_scaler_skips_overflowing_steps_and_regrows():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=2)
    opt = MixedPrecisionOptimizer([p], lambda ps: torch.optim.SGD(ps, lr=0.1), scaler)
    p.grad = torch.full((4,), float("inf"), dtype=torch.float16)
    assert opt.step() is False and scaler.scale == 512.0 and torch.all(p == 1)
    for _ in range(2):
        p.grad = torch.full((4,), 512.0, dtype=torch.float16)  # = 1.0 after unscaling
        assert opt.step() is True
    assert scaler.scale == 1024.0
    # two SGD steps of 0.1 on the fp32 master; the fp16 weight is its rounding
    assert opt.master[0].dtype == torch.float32
    assert torch.allclose(opt.master[0].detach(), torch.full((4,), 0.8))
    assert torch.equal(p.detach(), opt.master[0].detach().half())


def test_activation_checkpointing_same_losses_far_fewer_saved_bytes(fp32):
    m = llmlab.train(TrainConfig(steps=6, seed=3, activation_checkpointing=True), progress=False)
    assert relative_gap(_losses(m), _losses(fp32)) < 1e-5
    saved = m["ranks"][0]["memory_bytes"]["activations_peak"]
    full = fp32["ranks"][0]["memory_bytes"]["activations_peak"]
    assert saved < 0.3 * full, (saved, full)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_forced_nonfinite_gradient_is_skipped_in_fp32_and_bf16(dtype, monkeypatch, tmp_path):
    """Without a loss scaler too, one job-wide check skips the step (weights and Adam untouched),
    clipping never sees the inf norm, and the losses after it stay finite; the metrics file is
    strict JSON."""
    import json

    kw = dict(steps=4, seed=3, dtype=dtype, grad_clip=1.0, global_batch_size=4, seq_len=32)
    clean = llmlab.train(TrainConfig(**kw), progress=False)
    monkeypatch.setenv("LLMLAB_FORCE_OVERFLOW", "0:2")
    path = tmp_path / "m.json"
    m = llmlab.train(TrainConfig(metrics_json=str(path), **kw), progress=False)
    assert [s["skipped"] for s in m["steps"]] == [False, True, False, False]
    assert m["steps"][1]["grad_norm"] is None and m["steps"][2]["grad_norm"] > 0
    losses = _losses(m)
    assert all(isinstance(v, float) and math.isfinite(v) for v in losses), losses
    assert losses[:2] == _losses(clean)[:2]  # the fault is in step 2's gradient only
    assert losses[2] != _losses(clean)[2]  # step 2's update was not applied
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the metrics file"))


def test_consecutive_nonfinite_steps_stop_the_run_naming_the_flag(monkeypatch):
    monkeypatch.setenv("LLMLAB_FORCE_OVERFLOW", "0:1")
    with pytest.raises(Exception, match="--max-consecutive-skips 1"):
        llmlab.train(
            TrainConfig(steps=2, global_batch_size=2, seq_len=16, max_consecutive_skips=1), progress=False
        )


def test_metrics_are_strict_json_with_nonfinite_flagged():
    from llmlab.metrics.schema import strict_json
    from llmlab.training.grad_norm import clip_

    rec = strict_json({"steps": [{"loss": float("nan"), "grad_norm": None, "x": [1.0, float("inf")]}]})
    assert rec == {
        "steps": [{"loss": None, "grad_norm": None, "x": [1.0, None], "nonfinite": {"loss": "nan"}}]
    }
    json_text = __import__("json").dumps(rec, allow_nan=False)
    assert "NaN" not in json_text
    g = torch.ones(3)
    with pytest.raises(FloatingPointError):
        clip_([g], 1.0, float("inf"))
    assert torch.equal(g, torch.ones(3))
