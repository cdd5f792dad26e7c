"""`llmlab estimate`: the source articles' numbers through the CLI, its JSON and its errors
(the formulas themselves: tests/test_formulas.py)."""

import json
import math

import pytest

from llmlab.cli import main
from llmlab.model.config import get_preset

SEED_ARGS = [
    "estimate",
    "--params",
    "8e9",
    "--dtype",
    "fp32",
    "--optimizer",
    "adam",
    "--tokens",
    "2.5e11",
    "--gpu-tflops",
    "312",
    "--num-gpus",
    "1",
]
SEED_COMM = ["--tokens-per-step", "4e6", "--bandwidth-gb-s", "64", "--activation-comm-bytes", "80e9"]


def test_cli_prints_the_seed_numbers(capsys, tmp_path):
    out_json = tmp_path / "est.json"
    assert main(SEED_ARGS + SEED_COMM + ["--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for piece in (
        "32.00 GB",
        "64.00 GB",
        "1.200e+22",
        "445.2 days",
        "112.00 GB",
        "3.5 s",
        "62,500",
        "60.76 hours",
        "GB = 1e9 bytes",
    ):
        assert piece in text, piece
    d = json.loads(out_json.read_text())
    assert d["memory"]["bytes"] == {"params": 32e9, "grads": 32e9, "optimizer_states": 64e9, "total": 128e9}
    assert d["compute"]["training_flops"] == pytest.approx(1.2e22)
    assert d["compute"]["time_days"] == pytest.approx(445.16, abs=0.01)
    assert d["communication"]["time_per_step_s"] == pytest.approx(3.5)
    assert d["communication"]["total_time_h"] == pytest.approx(60.76, abs=0.005)
    assert d["inputs"]["params"] == 8e9 and "module" not in d["inputs"]  # the inputs, no CLI plumbing


def test_cli_zero_per_rank(capsys, tmp_path):
    out_json = tmp_path / "z.json"
    assert main(["estimate", "--params", "8e9", "--zero", "2", "--dp", "8", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "dp = 8" in text and "44.00 GB" in text
    d = json.loads(out_json.read_text())["zero"]
    assert d["bytes_per_rank"] == {"params": 32e9, "grads": 4e9, "optimizer_states": 8e9, "total": 44e9}
    assert [d["stages"][str(s)]["bytes_per_rank"]["total"] for s in range(4)] == [128e9, 72e9, 44e9, 16e9]
    assert d["stages"]["3"]["comm_bytes_per_step"]["total"] == round(3 * 7 / 8 * 32e9)


def test_cli_model_preset_uses_exact_parameter_count(capsys, tmp_path):
    out_json = tmp_path / "tiny.json"
    assert (
        main(
            [
                "estimate",
                "--model",
                "tiny",
                "--seq-len",
                "64",
                "--micro-batch-size",
                "2",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    d = json.loads(out_json.read_text())
    mc = get_preset("tiny")
    psi = mc.num_parameters()
    assert d["inputs"]["num_params"] == psi
    assert d["memory"]["bytes"]["params"] == 4 * psi
    per_layer = 64 * 2 * mc.hidden_size * (34 + 5 * mc.num_attention_heads * 64 / mc.hidden_size)
    assert d["memory"]["activations"] == mc.num_hidden_layers * round(per_layer)
    assert f"{psi:,} parameters" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--params=-8e9"], "--params must be > 0, got -8"),
        (["--params", "nan"], "--params must be a finite number, got nan"),
        (["--params", "inf"], "--params must be a finite number, got inf"),
        (["--params", "8e9", "--tokens", "-1"], "--tokens must be > 0"),
        (["--params", "8e9", "--tokens", "1e9", "--gpu-tflops", "0"], "--gpu-tflops must be > 0"),
        (
            ["--params", "8e9", "--tokens", "1e9", "--gpu-tflops", "1", "--num-gpus", "0"],
            "--num-gpus must be an integer >= 1, got 0",
        ),
        (
            ["--params", "8e9", "--tokens", "1e9", "--gpu-tflops", "1", "--mfu", "nan"],
            "--mfu must be a finite number",
        ),
        (
            ["--params", "8e9", "--tokens", "1e9", "--gpu-tflops", "1", "--mfu", "2"],
            "--mfu must be between 1e-09 and 1, got 2",
        ),
        (["--params", "1e300", "--tokens", "1e300"], "--params must be between 1e-09 and 1e+18, got 1e+300"),
        (
            ["--params", "8e9", "--tokens", "1e9", "--gpu-tflops", "1e-300"],
            "--gpu-tflops must be between 1e-09",
        ),
        (
            ["--params", "8e9", "--tokens", "1e9", "--tokens-per-step", "4e6", "--bandwidth-gb-s", "nan"],
            "--bandwidth-gb-s must be a finite number",
        ),
        (["--params", "8e9", "--activation-comm-bytes", "-1"], "--activation-comm-bytes must be >= 0"),
        (["--params", "8e9", "--gpu-memory-gb", "nan"], "--gpu-memory-gb must be a finite number, got nan"),
        (
            [
                "--params",
                "8e9",
                "--seq-len",
                "8",
                "--num-layers",
                "2",
                "--hidden-size",
                "64",
                "--num-heads",
                "5",
            ],
            "--num-heads 5 must divide --hidden-size 64",
        ),
        (
            ["--model", "tiny", "--seq-len", "8", "--num-heads", "0"],
            "--num-heads must be an integer >= 1, got 0",
        ),
        (["--model", "tiny", "--seq-len", "8", "--tp", "3"], "--tp 3 must divide --num-heads 4"),
        (["--model", "tiny", "--seq-len", "9", "--cp", "2"], "--cp 2 must divide --seq-len 9"),
        (["--params", "8e9", "--dtype", "int4"], "--dtype 'int4': expected one of fp32, bf16, fp16"),
        (["--params", "8e9", "--optimizer", "lion"], "--optimizer 'lion': expected one of"),
        (["--params", "8e9", "--zero", "1"], "--zero needs --dp"),
        (["--params", "8e9", "--zero", "5", "--dp", "2"], "--zero 5: expected one of 0, 1, 2, 3"),
        (["--params", "8e9", "--dp", "0"], "--dp must be an integer >= 1"),
        ([], "give exactly one of --params N or --model PRESET"),
        (
            ["--params", "8e9", "--tokens", "1e9", "--bandwidth-gb-s", "64"],
            "needs --tokens, --tokens-per-step",
        ),
        (["--params", "8e9", "--gpu-tflops", "312"], "--gpu-tflops needs --tokens"),
        (["--model", "nope"], "unknown model preset 'nope'"),
    ],
)
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
