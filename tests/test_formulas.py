"""llmlab.formulas: the source articles' and the papers' numbers, derived by hand in each test.

Each expected value is written from the paper's definition (bytes per parameter, the ring's
steps, the ZeRO stage's divisions), not copied from the implementation's output.
"""

import pytest

from llmlab.formulas.activations import activation_bytes_per_layer, llama_block_activation_bytes
from llmlab.formulas.communication import (
    communication_wall,
    ring_all_reduce_bytes,
    ring_all_reduce_time,
    ring_factor,
    ring_wire_factor,
    tp_block_comm_bytes,
    tp_replicated_kv_grad_bytes,
    tp_step_comm_bytes,
    zero_comm_bytes_per_step,
)
from llmlab.formulas.compute import block_flops, ideal_training_time_s, training_flops
from llmlab.formulas.memory import model_state_bytes, zero_model_state_bytes


def test_seed_memory_wall_8b_fp32_adam():
    b = model_state_bytes(8e9, "fp32", "adam")
    assert b == {
        "params": 32_000_000_000,
        "grads": 32_000_000_000,
        "optimizer_states": 64_000_000_000,
        "total": 128_000_000_000,
    }


def test_mixed_precision_is_2_2_12_psi():
    psi = 1_000_003
    b = model_state_bytes(psi, "bf16", "adam")
    assert (b["params"], b["grads"], b["optimizer_states"]) == (2 * psi, 2 * psi, 12 * psi)
    assert model_state_bytes(psi, "fp16", "sgd")["optimizer_states"] == 4 * psi  # master only
    assert model_state_bytes(psi, "fp32", "momentum")["optimizer_states"] == 4 * psi
    assert model_state_bytes(psi, "fp32", "sgd")["optimizer_states"] == 0


def test_seed_compute_wall_445_days():
    flops = training_flops(8e9, 2.5e11)
    assert flops == pytest.approx(1.2e22, rel=1e-12)
    days = ideal_training_time_s(flops, 312e12) / 86400
    assert round(days) == 445
    # Twice the GPUs at half the utilisation is the same time.
    assert ideal_training_time_s(flops, 312e12, num_gpus=2, mfu=0.5) == pytest.approx(days * 86400)


def test_seed_communication_wall_3_5_s_and_60_76_h():
    c = communication_wall(8e9, 2.5e11, 4e6, 64e9, "fp32", activation_comm_bytes=80e9)
    assert c["bytes_per_step"] == 112e9
    assert c["ring_factor"] == 2.0
    assert c["time_per_step_s"] == pytest.approx(3.5)
    assert c["num_steps"] == 62_500
    assert c["total_time_s"] / 3600 == pytest.approx(60.76, abs=0.005)
    # With a known ring size the exact factor 2(N-1)/N applies.
    c8 = communication_wall(8e9, 2.5e11, 4e6, 64e9, "fp32", 80e9, world_size=8)
    assert c8["time_per_step_s"] == pytest.approx(3.5 * 7 / 8)


def test_zero_stage_divisions():
    psi, n = 8e9, 4
    P, G, O = 32e9, 32e9, 64e9
    expect = {0: (P, G, O), 1: (P, G, O / n), 2: (P, G / n, O / n), 3: (P / n, G / n, O / n)}
    for stage, (p, g, o) in expect.items():
        b = zero_model_state_bytes(psi, stage, n, "fp32", "adam")
        assert (b["params"], b["grads"], b["optimizer_states"]) == (p, g, o)
        assert b["total"] == p + g + o


def test_zero_paper_figure1_7_5b_64_gpus():
    got = [zero_model_state_bytes(7.5e9, s, 64, "bf16", "adam")["total"] / 1e9 for s in range(4)]
    assert [round(x, 1) for x in got] == [120.0, 31.4, 16.6, 1.9]


def test_zero_shard_is_ceil_of_uneven_split():
    b = zero_model_state_bytes(10, 3, 4, "fp32", "adam")  # 10 params on 4 ranks: 3 each
    assert (b["params"], b["grads"], b["optimizer_states"]) == (12, 12, 24)


def test_zero_comm_volume_2psi_and_3psi():
    psi = 1e9
    for stage, mult in ((0, 2), (1, 2), (2, 2), (3, 3)):
        assert zero_comm_bytes_per_step(psi, stage, None, "fp32")["total"] == mult * 4 * psi
    ddp = zero_comm_bytes_per_step(psi, 0, 4, "bf16")
    assert ddp["all_reduce"] == 2 * 3 / 4 * 2 * psi and ddp["payload"]["all_reduce"] == 2 * psi
    z3 = zero_comm_bytes_per_step(psi, 3, 4, "bf16")
    assert z3["payload"] == {"all_reduce": 0, "reduce_scatter": 2 * psi, "all_gather": 4 * psi}
    assert z3["total"] == pytest.approx(1.5 * ddp["total"])
    assert ring_factor(2) == 1.0 and ring_factor(None) == 2.0


def test_activation_formula_variants():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B layer, the paper's Table 2 setting
    full = activation_bytes_per_layer(s, b, h, a)
    assert full == s * b * h * (34 + 5 * a * s / h)
    t = 8
    assert activation_bytes_per_layer(s, b, h, a, tp=t) == round(
        s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    )
    assert activation_bytes_per_layer(s, b, h, a, tp=t, sequence_parallel=True) == round(full / t)
    assert activation_bytes_per_layer(
        s, b, h, a, tp=t, sequence_parallel=True, recompute="selective"
    ) == round(s * b * h * 34 / t)
    assert activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    # Linear in the micro-batch.
    assert activation_bytes_per_layer(s, 4, h, a) == 4 * full


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: model_state_bytes(-1), "num_params must be > 0"),
        (lambda: model_state_bytes(0), "num_params must be > 0"),
        (lambda: model_state_bytes(float("nan")), "finite"),
        (lambda: model_state_bytes(1e9, "int8"), "unknown dtype 'int8'"),
        (lambda: model_state_bytes(1e9, "fp32", "lion"), "unknown optimizer 'lion'"),
        (lambda: zero_model_state_bytes(1e9, 4, 8), "ZeRO stage must be 0, 1, 2 or 3"),
        (lambda: zero_model_state_bytes(1e9, 1, 0), "dp .* must be an integer >= 1"),
        (lambda: activation_bytes_per_layer(128, 1, 64, 4, tp=3), "tp=3 must divide num_heads=4"),
        (lambda: ideal_training_time_s(1e20, 312e12, mfu=1.5), "mfu must be in"),
        (lambda: communication_wall(8e9, 2.5e11, 0, 64e9), "tokens_per_step must be > 0"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_ring_all_reduce_time_is_one_alpha_beta_model():
    """2(N-1) ring steps, each paying α and sending S/N bytes at β (Thakur et al. 2005, §4)."""
    S, beta, alpha = 1e9, 1e9, 1e-5
    for n in (2, 3, 4, 8):
        steps, chunk = 2 * (n - 1), S / n
        assert ring_all_reduce_time(S, n, beta, alpha) == pytest.approx(steps * (alpha + chunk / beta))
        assert ring_all_reduce_bytes(S, n) == pytest.approx(steps * chunk)  # bytes each rank sends
    assert ring_all_reduce_time(1e9, 4, bandwidth=1e9, latency=1e-5) == pytest.approx(1.5 + 6e-5)
    assert ring_all_reduce_time(1e9, 1, bandwidth=1e9, latency=1.0) == 0.0  # one rank sends nothing
    assert ring_all_reduce_time(S, None, beta) == 2 * S / beta  # the large-N limit
    with pytest.raises(ValueError, match="latency needs a world_size"):
        ring_all_reduce_time(S, None, beta, alpha)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        ring_all_reduce_time(1e9, 2, bandwidth=0)


def test_lab00_and_lab01_time_the_same_all_reduce_alike():
    """The lab 00 exercise's reference solution and the formula lab 01 uses are the same model."""
    from llmlab.solutions.lab00 import ring_all_reduce_seconds

    for args in ((112e9, 8, 64e9, 0.0), (4e6, 4, 1e9, 5e-5), (1024.0, 1, 1e9, 1e-6)):
        assert ring_all_reduce_seconds(*args) == pytest.approx(ring_all_reduce_time(*args))


def test_wire_factors_are_the_ring_phases():
    for n in (2, 4, 8):
        assert ring_wire_factor("all_reduce", n) == 2 * (n - 1) / n == ring_factor(n)
        for op in ("all_gather", "reduce_scatter", "all_to_all"):
            assert ring_wire_factor(op, n) == (n - 1) / n
    with pytest.raises(ValueError, match="unknown collective 'bcast'"):
        ring_wire_factor("bcast", 2)


def test_tp_block_and_step_bytes():
    b, s, h, L = 2, 8, 16, 3
    x = b * s * h * 4
    assert tp_block_comm_bytes(b, s, h, 1) == {"forward": {}, "backward": {}}
    # Megatron: f and g conjugate operators, one all-reduce each way per attention and MLP.
    assert tp_block_comm_bytes(b, s, h, 2) == {
        "forward": {"all_reduce": (2, x)},
        "backward": {"all_reduce": (2, x)},
    }
    step = tp_step_comm_bytes(b, s, h, L, 2)
    assert step == {"all_reduce": 4 * L * x + 2 * x + 3 * b * s * 4, "all_gather": 0, "reduce_scatter": 0}
    sp = tp_step_comm_bytes(b, s, h, L, 2, sequence_parallel=True)
    # SP replaces each all-reduce by reduce-scatter + all-gather of the same payload (same bytes).
    assert sp["reduce_scatter"] == step["all_reduce"] - 3 * b * s * 4
    assert sp["all_gather"] - sp["reduce_scatter"] == (2 * L + 1) * x  # the backward re-gathers
    assert tp_step_comm_bytes(b, s, h, L, 1) == {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    # kv heads replicated only when tp exceeds them
    assert tp_replicated_kv_grad_bytes(L, h, 4, 2, 2) == 0
    assert tp_replicated_kv_grad_bytes(L, h, 4, 2, 4) == 2 * (4 * h) * 2 * L * 4


def test_llama_block_activation_count_scales_as_its_tensors():
    """Linear in b; the tp-sharded part divides by t; with SP everything divides by t."""
    b, s, h, f, a = 2, 16, 32, 64, 4
    one = llama_block_activation_bytes(b, s, h, f, a)
    assert llama_block_activation_bytes(2 * b, s, h, f, a) == 2 * one
    assert llama_block_activation_bytes(b, s, h, f, a, t=2, sequence_parallel=True) == one // 2
    replicated = (6 * b * s * h + 2 * b * s) * 4  # the two RMSNorms' saved tensors
    assert llama_block_activation_bytes(b, s, h, f, a, t=2) == replicated + (one - replicated) // 2


def test_block_flops_is_6_flops_per_weight_per_token_plus_attention():
    b, s, h, f, a, kv = 1, 4, 8, 16, 2, 1
    d = h // a
    weights = h * h + 2 * h * kv * d + h * h + 3 * h * f  # q, k+v, o, gate+up+down
    fl = block_flops(b, s, h, f, a, kv)
    assert fl["total"] == 6 * b * s * weights + 12 * b * s * s * h
    assert block_flops(b, s, h, f, a, kv, t=2)["total"] == fl["total"] / 2
