"""Mixed precision (fp32 master weights, loss scaling) and activation checkpointing."""
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
