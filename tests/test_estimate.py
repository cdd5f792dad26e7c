"""llmlab.estimate: the seed document's numbers, ZeRO's divisions, the CLI and its errors."""
import json
import math

import pytest

from llmlab import estimate as E
from llmlab.cli import main
from llmlab.model.config import get_preset

SEED_ARGS = ["estimate", "--params", "8e9", "--dtype", "fp32", "--optimizer", "adam",
             "--tokens", "2.5e11", "--gpu-tflops", "312", "--num-gpus", "1"]
SEED_COMM = ["--tokens-per-step", "4e6", "--bandwidth-gb-s", "64", "--activation-comm-bytes", "80e9"]


def test_seed_memory_wall_8b_fp32_adam():
    b = E.model_state_bytes(8e9, "fp32", "adam")
    assert b == {"params": 32_000_000_000, "grads": 32_000_000_000,
                 "optimizer_states": 64_000_000_000, "total": 128_000_000_000}


def test_mixed_precision_is_2_2_12_psi():
    psi = 1_000_003
    b = E.model_state_bytes(psi, "bf16", "adam")
    assert (b["params"], b["grads"], b["optimizer_states"]) == (2 * psi, 2 * psi, 12 * psi)
    assert E.model_state_bytes(psi, "fp16", "sgd")["optimizer_states"] == 4 * psi  # master only
    assert E.model_state_bytes(psi, "fp32", "momentum")["optimizer_states"] == 4 * psi
    assert E.model_state_bytes(psi, "fp32", "sgd")["optimizer_states"] == 0


def test_seed_compute_wall_445_days():
    flops = E.training_flops(8e9, 2.5e11)
    assert flops == pytest.approx(1.2e22, rel=1e-12)
    days = E.ideal_training_time_s(flops, 312e12) / E.SECONDS_PER_DAY
    assert round(days) == 445
    # Twice the GPUs at half the utilisation is the same time.
    assert E.ideal_training_time_s(flops, 312e12, num_gpus=2, mfu=0.5) == pytest.approx(days * 86400)


def test_seed_communication_wall_3_5_s_and_60_76_h():
    c = E.communication_wall(8e9, 2.5e11, 4e6, 64e9, "fp32", activation_comm_bytes=80e9)
    assert c["bytes_per_step"] == 112e9
    assert c["ring_factor"] == 2.0
    assert c["time_per_step_s"] == pytest.approx(3.5)
    assert c["num_steps"] == 62_500
    assert c["total_time_s"] / 3600 == pytest.approx(60.76, abs=0.005)
    # With a known ring size the exact factor 2(N-1)/N applies.
    c8 = E.communication_wall(8e9, 2.5e11, 4e6, 64e9, "fp32", 80e9, world_size=8)
    assert c8["time_per_step_s"] == pytest.approx(3.5 * 7 / 8)


def test_zero_stage_divisions():
    psi, n = 8e9, 4
    P, G, O = 32e9, 32e9, 64e9
    expect = {0: (P, G, O), 1: (P, G, O / n), 2: (P, G / n, O / n), 3: (P / n, G / n, O / n)}
    for stage, (p, g, o) in expect.items():
        b = E.zero_model_state_bytes(psi, stage, n, "fp32", "adam")
        assert (b["params"], b["grads"], b["optimizer_states"]) == (p, g, o)
        assert b["total"] == p + g + o


def test_zero_paper_figure1_7_5b_64_gpus():
    got = [E.zero_model_state_bytes(7.5e9, s, 64, "bf16", "adam")["total"] / 1e9 for s in range(4)]
    assert [round(x, 1) for x in got] == [120.0, 31.4, 16.6, 1.9]


def test_zero_shard_is_ceil_of_uneven_split():
    b = E.zero_model_state_bytes(10, 3, 4, "fp32", "adam")  # 10 params on 4 ranks: 3 each
    assert (b["params"], b["grads"], b["optimizer_states"]) == (12, 12, 24)


def test_zero_comm_volume_2psi_and_3psi():
    psi = 1e9
    for stage, mult in ((0, 2), (1, 2), (2, 2), (3, 3)):
        assert E.zero_comm_bytes_per_step(psi, stage, None, "fp32")["total"] == mult * 4 * psi
    ddp = E.zero_comm_bytes_per_step(psi, 0, 4, "bf16")
    assert ddp["all_reduce"] == 2 * 3 / 4 * 2 * psi and ddp["payload"]["all_reduce"] == 2 * psi
    z3 = E.zero_comm_bytes_per_step(psi, 3, 4, "bf16")
    assert z3["payload"] == {"all_reduce": 0, "reduce_scatter": 2 * psi, "all_gather": 4 * psi}
    assert z3["total"] == pytest.approx(1.5 * ddp["total"])
    assert E.ring_factor(2) == 1.0 and E.ring_factor(None) == 2.0


def test_activation_formula_variants():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B layer, the paper's Table 2 setting
    full = E.activation_bytes_per_layer(s, b, h, a)
    assert full == s * b * h * (34 + 5 * a * s / h)
    t = 8
    assert E.activation_bytes_per_layer(s, b, h, a, tp=t) == round(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert E.activation_bytes_per_layer(s, b, h, a, tp=t, sequence_parallel=True) == round(full / t)
    assert E.activation_bytes_per_layer(s, b, h, a, tp=t, sequence_parallel=True,
                                        recompute="selective") == round(s * b * h * 34 / t)
    assert E.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    # Linear in the micro-batch.
    assert E.activation_bytes_per_layer(s, 4, h, a) == 4 * full


@pytest.mark.parametrize("call, match", [
    (lambda: E.model_state_bytes(-1), "num_params must be > 0"),
    (lambda: E.model_state_bytes(0), "num_params must be > 0"),
    (lambda: E.model_state_bytes(float("nan")), "finite"),
    (lambda: E.model_state_bytes(1e9, "int8"), "unknown dtype 'int8'"),
    (lambda: E.model_state_bytes(1e9, "fp32", "lion"), "unknown optimizer 'lion'"),
    (lambda: E.zero_model_state_bytes(1e9, 4, 8), "ZeRO stage must be 0, 1, 2 or 3"),
    (lambda: E.zero_model_state_bytes(1e9, 1, 0), "dp .* must be an integer >= 1"),
    (lambda: E.activation_bytes_per_layer(128, 1, 64, 4, tp=3), "tp=3 must divide num_heads=4"),
    (lambda: E.ideal_training_time_s(1e20, 312e12, mfu=1.5), "mfu must be in"),
    (lambda: E.communication_wall(8e9, 2.5e11, 0, 64e9), "tokens_per_step must be > 0"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cli_prints_the_seed_numbers(capsys, tmp_path):
    out_json = tmp_path / "est.json"
    assert main(SEED_ARGS + SEED_COMM + ["--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for piece in ("32.00 GB", "64.00 GB", "1.200e+22", "445.2 days", "112.00 GB", "3.5 s",
                  "62,500", "60.76 hours", "GB = 1e9 bytes"):
        assert piece in text, piece
    d = json.loads(out_json.read_text())
    assert d["memory"]["bytes"] == {"params": 32e9, "grads": 32e9, "optimizer_states": 64e9,
                                    "total": 128e9}
    assert d["compute"]["training_flops"] == pytest.approx(1.2e22)
    assert d["compute"]["time_days"] == pytest.approx(445.16, abs=0.01)
    assert d["communication"]["time_per_step_s"] == pytest.approx(3.5)
    assert d["communication"]["total_time_h"] == pytest.approx(60.76, abs=0.005)


def test_cli_zero_per_rank(capsys, tmp_path):
    out_json = tmp_path / "z.json"
    assert main(["estimate", "--params", "8e9", "--zero", "2", "--dp", "8", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "dp = 8" in text and "44.00 GB" in text
    d = json.loads(out_json.read_text())["zero"]
    assert d["bytes_per_rank"] == {"params": 32e9, "grads": 4e9, "optimizer_states": 8e9,
                                   "total": 44e9}
    assert [d["stages"][str(s)]["bytes_per_rank"]["total"] for s in range(4)] == [128e9, 72e9, 44e9, 16e9]
    assert d["stages"]["3"]["comm_bytes_per_step"]["total"] == round(3 * 7 / 8 * 32e9)


def test_cli_model_preset_uses_exact_parameter_count(capsys, tmp_path):
    out_json = tmp_path / "tiny.json"
    assert main(["estimate", "--model", "tiny", "--seq-len", "64", "--micro-batch-size", "2",
                 "--json", str(out_json)]) == 0
    d = json.loads(out_json.read_text())
    mc = get_preset("tiny")
    psi = mc.num_parameters()
    assert d["inputs"]["num_params"] == psi
    assert d["memory"]["bytes"]["params"] == 4 * psi
    per_layer = 64 * 2 * mc.hidden_size * (34 + 5 * mc.num_attention_heads * 64 / mc.hidden_size)
    assert d["memory"]["activations"] == mc.num_hidden_layers * round(per_layer)
    assert f"{psi:,} parameters" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--params=-8e9"], "num_params must be > 0"),
    (["--params", "8e9", "--dtype", "int4"], "unknown dtype 'int4'"),
    (["--params", "8e9", "--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--params", "8e9", "--zero", "1"], "--zero needs --dp"),
    (["--params", "8e9", "--zero", "5", "--dp", "2"], "ZeRO stage must be 0, 1, 2 or 3"),
    (["--params", "8e9", "--dp", "0"], "must be an integer >= 1"),
    ([], "give exactly one of --params N or --model PRESET"),
    (["--params", "8e9", "--tokens", "1e9", "--bandwidth-gb-s", "64"], "needs --tokens, --tokens-per-step"),
    (["--params", "8e9", "--gpu-tflops", "312"], "--gpu-tflops needs --tokens"),
    (["--model", "nope"], "unknown model preset 'nope'"),
])
def test_cli_bad_input_exits_2_with_message(capsys, argv, message):
    assert main(["estimate"] + argv) == 2
    err = capsys.readouterr().err
    assert "llmlab estimate: error:" in err and message in err, err


def test_cli_days_scale_with_gpus(tmp_path):
    p1, p8 = tmp_path / "1.json", tmp_path / "8.json"
    main(SEED_ARGS + ["--json", str(p1)])
    main(SEED_ARGS[:-1] + ["8", "--json", str(p8)])
    d1, d8 = (json.loads(p.read_text())["compute"]["time_days"] for p in (p1, p8))
    assert math.isclose(d1 / d8, 8.0)
