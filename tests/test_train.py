"""`llmlab train` on one rank: falling loss, CONTRACT metrics, exact memory accounting, errors."""

import json
import re
import subprocess
import sys

import pytest

import llmlab
from llmlab.cli import main
from llmlab.model.config import get_preset
from llmlab.training.config import TrainConfig, validate


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "metrics.json"
    metrics = llmlab.train(TrainConfig(steps=12, metrics_json=str(path), seed=1), progress=False)
    return metrics, json.loads(path.read_text())


def test_loss_falls_and_metrics_follow_the_contract(run):
    metrics, on_disk = run
    assert on_disk == json.loads(json.dumps(metrics))
    steps = metrics["steps"]
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.8
    assert all(s["step_time_s"] > 0 and s["tokens_per_s"] > 0 for s in steps)
    cfg = metrics["config"]
    assert cfg["world_size"] == 1 and cfg["model"] == "tiny" and cfg["seed"] == 1
    (rank,) = metrics["ranks"]
    assert rank["coords"] == {"dp": 0, "tp": 0, "pp": 0, "ep": 0, "cp": 0}
    assert set(rank["comm_bytes"]) >= {
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "all_to_all",
        "send",
        "recv",
    }
    assert sum(rank["comm_bytes"].values()) == 0  # one rank communicates nothing


def test_memory_is_measured_and_equals_the_formula(run):
    metrics, _ = run
    mem = metrics["ranks"][0]["memory_bytes"]
    cfg = get_preset("tiny")
    psi = cfg.num_parameters()
    n_tensors = 2 + 9 * cfg.num_hidden_layers + 1  # embed, lm_head, 9 per layer, final norm
    assert mem["params"] == 4 * psi  # fp32 weights: 4 bytes each
    assert mem["grads"] == 4 * psi  # one fp32 gradient per weight
    assert mem["optimizer_states"] == 8 * psi + 4 * n_tensors  # Adam m, v + a step scalar each
    # Saved activations: at least the logits (B*T*V fp32) and the embeddings of every layer.
    B, T = 16, 64
    assert mem["activations_peak"] > B * T * cfg.vocab_size * 4


def test_same_seed_same_losses_different_seed_different(run):
    metrics, _ = run
    again = llmlab.train(TrainConfig(steps=3, seed=1), progress=False)
    other = llmlab.train(TrainConfig(steps=3, seed=2), progress=False)
    assert [s["loss"] for s in again["steps"]] == [s["loss"] for s in metrics["steps"][:3]]
    assert other["steps"][0]["loss"] != metrics["steps"][0]["loss"]


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"dp": 3, "global_batch_size": 10}, "dp=3 must divide --global-batch-size 10"),
        ({"dp": 2, "tp": 2, "pp": 1, "ep": 3}, "ep=3 must divide dp=2"),
        ({"num_microbatches": 3}, "--num-microbatches 3 must divide the per-rank batch 16"),
        (
            {"model": "tiny-moe", "num_experts": 4, "ep": 3, "dp": 3, "global_batch_size": 12},
            "ep=3 must divide num_experts=4",
        ),
        ({"steps": 0}, "--steps must be >= 1"),
        ({"resume": True}, "--resume needs --checkpoint-dir"),
        ({"checkpoint_every": 2}, "--checkpoint-every needs --checkpoint-dir"),
    ],
)
def test_bad_layouts_are_refused_before_launch(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("*", r"\*").replace("+", r"\+")):
        validate(TrainConfig(**kw))


def test_output_paths_of_the_wrong_kind_are_refused_before_launch(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for kw in ({"checkpoint_dir": str(a_file)}, {"save_model": str(a_file)}):
        with pytest.raises(ValueError, match="is a file; it must be a folder"):
            validate(TrainConfig(**kw))
    with pytest.raises(ValueError, match="--metrics-json .* is a folder"):
        validate(TrainConfig(metrics_json=str(tmp_path)))
    validate(TrainConfig(checkpoint_dir=str(tmp_path / "new"), metrics_json=str(a_file)))


def test_cli_resume_of_a_finished_run_says_there_is_nothing_to_train(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert main(["train", "--steps", "2", "--no-progress", "--checkpoint-dir", ck, "--resume"]) == 0
    assert f"no valid checkpoint in {ck}: starting from step 1" in capsys.readouterr().err
    assert main(["train", "--steps", "2", "--no-progress", "--checkpoint-dir", ck, "--resume"]) == 0
    assert f"nothing to train: the latest checkpoint in {ck} is already at step 2" in capsys.readouterr().out


def test_cli_train_writes_metrics_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["train", "--steps", "2", "--no-progress", "--metrics-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["steps"]) == 2 and data["config"]["steps"] == 2
    # the summary's throughput is the whole run's: its tokens over the sum of its step times
    whole = 2 * 16 * 64 / sum(s["step_time_s"] for s in data["steps"])
    assert f"({whole:.0f} tokens/s over 2 steps, 1 rank)" in capsys.readouterr().out
    assert main(["train", "--dp", "3", "--global-batch-size", "10"]) == 2
    assert "dp=3 must divide --global-batch-size 10" in capsys.readouterr().err


def test_config_file_with_command_line_override(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"steps": 2, "seq-len": 32, "lr": 0.01}))
    out = tmp_path / "m.json"
    assert (
        main(["train", "--config", str(f), "--steps", "1", "--no-progress", "--metrics-json", str(out)]) == 0
    )
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["steps"], cfg["seq_len"], cfg["lr"]) == (1, 32, 0.01)
    f.write_text(json.dumps({"stepz": 2}))
    with pytest.raises(ValueError, match="unknown keys.*stepz"):
        TrainConfig.from_file(f)
    for text, msg in (
        ("{bad", "is not valid JSON"),
        ("[1]", "must hold a mapping"),
        ('{"steps": "2"}', "steps must be int, got '2'"),
        ('{"steps": true}', "steps must be int, got True"),
        ('{"grad_clip": "x"}', "grad_clip must be float or null"),
    ):
        f.write_text(text)
        with pytest.raises(ValueError, match=msg):
            TrainConfig.from_file(f)
    f.write_text('{"steps": 2, "lr": 1, "grad_clip": null, "sequence-parallel": false}')
    assert TrainConfig.from_file(f).lr == 1
    y = tmp_path / "c.yaml"
    y.write_text("steps: 2\nlr: 3e-3\n")  # YAML 1.1 reads 3e-3 as a string
    assert TrainConfig.from_file(y).lr == 0.003
    y.write_text("steps: [\n")
    with pytest.raises(ValueError, match="c.yaml is not valid YAML"):
        TrainConfig.from_file(y)


def test_every_train_flag_comes_from_a_field_with_help_and_default(capsys, monkeypatch):
    import dataclasses
    from llmlab.cli import build_parser

    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(TrainConfig):
        help_ = f.metadata.get("help")
        assert help_, f"TrainConfig.{f.name} has no help text (use option(default, help))"
        flag = "--" + f.name.replace("_", "-")
        assert f"{flag} " in text and " ".join(help_.split()) in text
        if not isinstance(f.default, bool) and "default" not in help_:
            shown = "none" if f.default is None else f.default
            assert f"{' '.join(help_.split())} (default: {shown})" in text, f.name
    # Parsing gives exactly the flags that were typed, with the field's type.
    args = build_parser().parse_args(["train", "--seq-len", "32", "--lr", "0.01", "--sequence-parallel"])
    given = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(TrainConfig)}}
    assert given == {"seq_len": 32, "lr": 0.01, "sequence_parallel": True}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_choices_are_checked_in_python_too():
    with pytest.raises(ValueError, match=r"--dtype 'fp8': expected fp32, bf16 or fp16"):
        validate(TrainConfig(dtype="fp8"))
    with pytest.raises(ValueError, match=r"--zero 4: expected 0, 1, 2 or 3"):
        validate(TrainConfig(zero=4))


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmlab {llmlab.__version__}"


def test_a_failed_rank_is_one_error_line_its_traceback_and_log_path(monkeypatch, capsys):
    import shutil
    import llmlab.training.trainer as trainer

    def boom(cfg, progress):
        def fail():
            raise ZeroDivisionError("rank 1 divides by zero")

        return llmlab.launch(lambda: fail() if __import__("torch").distributed.get_rank() == 1 else 0, 2)

    monkeypatch.setattr(trainer, "train", boom)
    assert main(["train", "--steps", "1"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "llmlab train: error: rank 1 failed: ZeroDivisionError: rank 1 divides by zero"
    assert err[1] == "Traceback (most recent call last):"
    assert err[-2] == "ZeroDivisionError: rank 1 divides by zero"  # the rank's, not the CLI's
    assert sum(line.startswith("Traceback") for line in err) == 1
    assert err[-1].startswith("log: ") and err[-1].endswith("/rank1.log")
    log = err[-1][len("log: ") :]
    assert "rank 1 divides by zero" in open(log).read()
    shutil.rmtree(log.rsplit("/", 1)[0])


def test_python_dash_m_llmlab_is_the_cli(tmp_path):
    model_dir = tmp_path / "model"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmlab",
            "train",
            "--steps",
            "2",
            "--no-progress",
            "--save-model",
            str(model_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "loss" in proc.stdout
    from llmlab.model.hf import load_hf_model

    assert load_hf_model(model_dir).config.num_hidden_layers == 4


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"seed": 2**64}, "--seed must be an integer in [0, 2**32), got 18446744073709551616"),
        ({"seed": -1}, "--seed must be an integer in [0, 2**32)"),
        ({"lr": float("nan")}, "--lr must be a finite number, got nan"),
        ({"lr": float("inf")}, "--lr must be a finite number, got inf"),
        ({"min_lr": -1.0}, "--min-lr must be >= 0"),
        ({"grad_clip": float("nan")}, "--grad-clip must be a finite number"),
        ({"bucket_mb": 0.0}, "--bucket-mb must be > 0"),
        ({"capacity_factor": -1.0, "model": "tiny-moe"}, "--capacity-factor must be > 0"),
        ({"num_experts": 0}, "--num-experts must be >= 1, got 0"),
        ({"top_k": 5, "model": "tiny-moe"}, "--top-k 5 must be <= the number of experts 4"),
        ({"dp": 0}, "--dp must be >= 1, got 0"),
        ({"seq_len": -3}, "--seq-len must be >= 1, got -3"),
        ({"warmup_steps": -1}, "--warmup-steps must be >= 0"),
        ({"steps": 2.5}, "--steps must be an integer, got 2.5"),
    ],
)
def test_every_numeric_flag_is_checked_naming_it(kw, msg):
    from llmlab.training.config import check_inputs

    with pytest.raises(ValueError, match=re.escape(msg)):
        check_inputs(TrainConfig(**kw))


def test_cli_refuses_a_huge_seed_and_saving_a_moe_model_before_training(tmp_path, capsys, monkeypatch):
    import llmlab.training.trainer as trainer

    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("training started"))
    assert main(["train", "--seed", str(2**64)]) == 2
    assert "--seed must be an integer in [0, 2**32)" in capsys.readouterr().err
    out = tmp_path / "moe"
    assert main(["train", "--model", "tiny-moe", "--save-model", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--save-model" in err and "mixture-of-experts" in err and "--model tiny-moe" in err
    assert not out.exists()
