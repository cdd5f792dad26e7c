"""llmlab plan: the layouts it lists, its memory numbers against llmlab.formulas and the source
articles, its refusals, and a small real --validate on 2 ranks."""

import json
import subprocess
import sys

import pytest

import llmlab
from llmlab.formulas.communication import collective_time, ring_all_reduce_time
from llmlab.formulas.memory import zero_model_state_bytes
from llmlab.formulas.pipeline import microbatches_in_flight, pipeline_bubble_fraction
from llmlab.parallel.pipeline_schedules import bubble_fraction_theory
from llmlab.planner.cluster import cluster_preset
from llmlab.planner.layout import Layout, why_invalid
from llmlab.planner.memory import memory_per_gpu
from llmlab.planner.specs import Workload, from_params, from_preset
from llmlab.planner.validate import spearman


@pytest.fixture(scope="module")
def plan8b(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "p.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "llmlab",
            "plan",
            "--params",
            "8e9",
            "--num-gpus",
            "8",
            "--gpu-memory-gb",
            "80",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    return json.loads(out.read_text())


def test_8b_plan_lists_layouts_of_8_gpus_best_fits_and_has_dp2_tp4(plan8b):
    rows = plan8b["layouts"]
    assert len(rows) > 100
    assert all(r["dp"] * r["tp"] * r["pp"] * r["cp"] == 8 for r in rows)
    assert rows[0]["fits"] and rows[0]["memory_bytes_per_gpu"] <= 80e9
    times = [r["step_time_s"] for r in rows if r["fits"]]
    assert times == sorted(times)
    dp2tp4 = [r for r in rows if (r["dp"], r["tp"], r["pp"], r["cp"]) == (2, 4, 1, 1)]
    assert dp2tp4 and any(r["fits"] for r in dp2tp4)
    r = dp2tp4[0]
    assert r["step_time_s"] == pytest.approx(r["compute_s"] + r["exposed_comm_s"] + r["bubble_s"])
    assert r["comm_s"]["tp"] > 0 and 0 < r["mfu"] < 1
    same = llmlab.plan(params=8e9, num_gpus=8, gpu_memory_gb=80)  # the Python API, the CLI's units
    assert same["cluster"]["gpu_memory_bytes"] == 80e9
    assert [x["name"] for x in same["layouts"][:5]] == [x["name"] for x in rows[:5]]


def test_8b_model_states_match_the_source_articles_and_formulas():
    """fp32 Adam, 8e9 parameters: 32 + 32 + 64 GB unsharded; DP2×TP4 holds a quarter."""
    m = from_params(8e9)
    assert m.num_params() == pytest.approx(8e9, rel=1e-3)
    w = Workload(4096, 4096 * 16, "fp32", "adam")
    c = cluster_preset("a800", 8)
    one = memory_per_gpu(m, Layout(), w, c)
    assert one["params"] / 1e9 == pytest.approx(32, rel=2e-3)
    assert one["optimizer_states"] / 1e9 == pytest.approx(64, rel=2e-3)
    lay = Layout(dp=2, tp=4, zero=1)
    mem = memory_per_gpu(m, lay, w, c)
    from llmlab.planner.memory import rank_params

    dense, _ = rank_params(m, lay, "first")
    assert dense == pytest.approx(m.num_params() / 4, rel=0.01)  # norms are replicated
    want = zero_model_state_bytes(dense, 1, 2, "fp32", "adam")
    assert mem["model_states"] == want["total"]


def test_tiny_memory_matches_what_the_trainer_holds():
    """Counts measured with `llmlab train --model tiny` (fp32 AdamW): parameters per rank."""
    m, w = from_preset("tiny"), Workload(256, 256 * 16, "fp32", "adamw")
    c = cluster_preset("a100", 4, reserved_bytes=0)
    from llmlab.planner.memory import rank_params

    assert rank_params(m, Layout(tp=4), "first")[0] * 4 == 248064  # kv heads replicated
    assert rank_params(m, Layout(pp=4, num_microbatches=4), "first")[0] * 4 == 262656
    assert rank_params(m, Layout(pp=4, num_microbatches=4), "last")[0] * 4 == 262912
    assert memory_per_gpu(m, Layout(dp=4, zero=3), w, c)["params"] == 229952


def test_new_formulas():
    assert collective_time("all_reduce", 1e6, 4, 1e9, 1e-5) == ring_all_reduce_time(1e6, 4, 1e9, 1e-5)
    assert collective_time("all_gather", 4e6, 4, 1e9, 0) == pytest.approx(3e-3)
    for p, m, v in ((4, 8, 1), (4, 8, 2), (1, 3, 1)):
        assert pipeline_bubble_fraction(p, m, v) == bubble_fraction_theory(
            "interleaved" if v > 1 else "1f1b", p, m, v
        )
    from llmlab.formulas.communication import p2p_time
    from llmlab.formulas.pipeline import pipeline_bubble_time

    assert p2p_time(1e6, 1e9, 1e-5) == pytest.approx(1e-5 + 1e-3) and p2p_time(0, 1e9, 1e-5) == 0
    assert pipeline_bubble_time(10.0, 4, 8) == pytest.approx(10 * 3 / 8)
    assert pipeline_bubble_time(10.0, 4, 8, 2) == pytest.approx(10 * 3 / 16)
    assert microbatches_in_flight("interleaved", 4, 8, 2) == pytest.approx(4 * (1 + 3 / 8))
    assert microbatches_in_flight("1f1b", 4, 8) == 4
    assert microbatches_in_flight("gpipe", 4, 8) == 8
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("broadcast", 1, 2, 1)


def test_invalid_input_names_the_constraint():
    m, w = from_preset("tiny"), Workload(256, 256 * 16, "fp32")
    assert "tp=3 must divide the 4 attention heads" in why_invalid(Layout(tp=3), m, w, 8)
    assert "must fit in one node" in why_invalid(Layout(tp=4), m, w, 2)
    assert "dp=3 must divide the global batch" in why_invalid(Layout(dp=3), m, w, 8)
    with pytest.raises(ValueError, match="gpus-per-node 8 must divide --num-gpus 12"):
        llmlab.plan(params=8e9, num_gpus=12)
    with pytest.raises(ValueError, match="exactly one of"):
        llmlab.plan("tiny", params=8e9)
    with pytest.raises(ValueError, match="unknown model"):
        llmlab.plan("no-such-model")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmlab",
            "plan",
            "--params",
            "8e9",
            "--seq-len",
            "1000",
            "--global-batch-tokens",
            "4096",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--seq-len 1000 must divide" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "llmlab", "plan", "--model", "tiny", "--num-gpus", "3", "--validate"],
        capture_output=True,
        text=True,
    )  # refused before calibrating
    assert r.returncode == 2 and "dp=3 must divide the global batch of 16" in r.stderr
    assert "calibrated" not in r.stdout


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "schedule,p,m,v",
    [
        ("1f1b", 2, 1, 1),
        ("1f1b", 4, 2, 1),
        ("1f1b", 4, 8, 1),
        ("gpipe", 3, 4, 1),
        ("interleaved", 2, 2, 2),
        ("interleaved", 2, 4, 2),
        ("interleaved", 2, 2, 4),
        ("interleaved", 4, 4, 2),
        ("interleaved", 4, 8, 2),
        ("interleaved", 3, 6, 2),
    ],
)
def test_in_flight_micro_batches_are_the_schedules_own(schedule, p, m, v):
    """The planner's activation count per pipeline rank equals the peak of forwards not yet
    backwarded in the order the runner executes (chunks of 1/v of a rank's layers); interleaved
    with m = p (PP2 v2 m2: 2, not 2.5) is where Korthikanti's closed form over-counts."""
    from llmlab.parallel.pipeline_schedules import F, compute_order

    for rank, ops in enumerate(compute_order(schedule, p, m, v)):
        held = peak = 0
        for op, *_ in ops:
            held += 1 if op == F else -1
            peak = max(peak, held)
        assert microbatches_in_flight(schedule, p, m, v, rank=rank) == pytest.approx(peak / v)
    assert microbatches_in_flight("interleaved", 2, 2, 2) == 2.0
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, pp=2\)"):
        microbatches_in_flight("1f1b", 2, 2, rank=2)


def test_validate_on_2_ranks(tmp_path):
    """Real calibration and training on 2 gloo ranks: memory within 10 %."""
    from llmlab.planner.calibrate import calibrate
    from llmlab.planner.validate import validate

    c = calibrate(2, "tiny", quick=True)
    assert c.op_links["all_reduce"]["bandwidth"] > 0 and c.op_links["model"]
    v = validate(c, "tiny", count=2, steps=3, warmup=1, spread=1.2)
    assert len(v["layouts"]) >= 2
    assert v["memory_max_rel_err"] < 0.10
    assert all(r["step_time_measured_s"] > 0 for r in v["layouts"])


def test_hf_config_gives_the_published_count(tmp_path):
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from llmlab.planner.specs import LARGE_MODELS, from_hf_config

    spec = from_hf_config(tmp_path / "config.json")
    assert spec.num_params() == 8_030_261_248 == LARGE_MODELS["llama3-8b"].num_params()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_hf_config(tmp_path / "missing.json")


def test_alpha_beta_fit_recovers_known_link():
    """Rows made with the α-β model itself (α = 50 µs, β = 2 GB/s on 4 ranks) are fitted back."""
    from llmlab.planner.calibrate import fit_alpha_beta

    rows = [
        {"op": op, "size_bytes": s, "time_s": collective_time(op, s, 4, 2e9, 5e-5)}
        for op in ("all_reduce", "all_gather")
        for s in (4096, 65536, 2**20, 2**22)
    ]
    fit = fit_alpha_beta(rows, 4)
    for op in ("all_reduce", "all_gather"):
        assert fit[op]["latency"] == pytest.approx(5e-5, rel=1e-6)
        assert fit[op]["bandwidth"] == pytest.approx(2e9, rel=1e-6)


def test_moe_layouts_split_experts_and_pay_all_to_all():
    r = llmlab.plan("mixtral-8x7b", cluster="h100", num_gpus=16, zero_stages=(1,), max_microbatches=8)
    ep = [x for x in r["layouts"] if x["ep"] > 1]
    assert ep and all(x["dp"] % x["ep"] == 0 and 8 % x["ep"] == 0 for x in ep)
    assert all(x["comm_s"]["ep"] > 0 for x in ep)
    a = next(x for x in r["layouts"] if (x["dp"], x["tp"], x["ep"], x["pp"]) == (16, 1, 8, 1))
    b = next(
        x
        for x in r["layouts"]
        if (x["dp"], x["tp"], x["ep"], x["pp"]) == (16, 1, 1, 1)
        and x["num_microbatches"] == a["num_microbatches"]
        and x["recompute"] == a["recompute"]
    )
    assert a["memory"]["params"] < b["memory"]["params"]  # experts split 8 ways


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--peak-tflops", "-1"], "--peak-tflops must be > 0, got -1"),
        (["--peak-tflops", "nan"], "--peak-tflops must be a finite number, got nan"),
        (["--peak-tflops", "0"], "--peak-tflops must be > 0, got 0"),
        (["--gpu-memory-gb", "nan"], "--gpu-memory-gb must be a finite number, got nan"),
        (["--gpu-memory-gb", "0"], "--gpu-memory-gb must be > 0, got 0"),
        (["--tokens=-1e9"], "--tokens must be > 0, got -1e+09"),
        (["--params", "inf"], "--params must be a finite number, got inf"),
        (["--num-heads", "0"], "--num-heads must be an integer >= 1, got 0"),
        (["--num-layers", "0"], "--num-layers must be an integer >= 1, got 0"),
        (["--vocab-size", "0"], "--vocab-size must be an integer >= 1, got 0"),
        (["--num-heads", "8", "--num-kv-heads", "16"], "--num-kv-heads 16 must divide --num-heads 8"),
        (["--hidden-size", "4096", "--num-heads", "5"], "--num-heads 5 must divide --hidden-size 4096"),
        (["--num-kv-heads", "3"], "kv_heads 3 (--num-kv-heads) must divide heads 32 (--num-heads)"),
        (["--global-batch-tokens", "nan"], "--global-batch-tokens must be a finite number, got nan"),
        (["--achievable-fraction", "nan"], "--achievable-fraction must be a finite number, got nan"),
        (["--achievable-fraction", "1.5"], "--achievable-fraction must be between 1e-09 and 1, got 1.5"),
        (["--global-batch-tokens", "1e300"], "--global-batch-tokens must be between 1e-09 and 1e+18"),
        (["--peak-tflops", "1e-300"], "--peak-tflops must be between 1e-09 and 1e+18, got 1e-300"),
        (["--num-gpus", "16777216"], "--num-gpus must be <= 1,048,576, got 16,777,216"),
        (["--inter-bw-gb-s", "inf"], "--inter-bw-gb-s must be a finite number, got inf"),
        (["--num-gpus", "0"], "--num-gpus must be an integer >= 1, got 0"),
    ],
)
def test_plan_refuses_each_absurd_input_naming_it(flags, message, capsys):
    from llmlab.cli import main

    argv = ["plan"] + (["--params", "8e9"] if "--params" not in flags else []) + flags
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "llmlab plan: error: " in err and message in err, err


def test_plan_api_checks_the_shape_too():
    from llmlab.planner.specs import ModelSpec

    with pytest.raises(ValueError, match="--num-heads must be an integer >= 1, got 0"):
        llmlab.plan(params=8e9, heads=0)
    with pytest.raises(ValueError, match=r"heads \(--num-heads\) must be an integer >= 1, got 0"):
        llmlab.plan(ModelSpec(4, 64, 0, 1, 128, 256))
    with pytest.raises(ValueError, match=r"kv_heads 8 \(--num-kv-heads\) must divide heads 4"):
        llmlab.plan(params=8e9, heads=4, kv_heads=8)
    with pytest.raises(ValueError, match=r"--peak-tflops \(--dtype bf16\) must be a finite number > 0"):
        llmlab.plan(params=8e9, peak_flops={"bf16": float("nan")})
    with pytest.raises(ValueError, match="--tokens .* must be a finite number > 0"):
        llmlab.plan(params=8e9, workload=Workload(token_budget=-1.0))


def test_plan_exits_1_with_a_headline_when_no_layout_fits(tmp_path, capsys):
    from llmlab.cli import main

    out = tmp_path / "p.json"
    assert main(["plan", "--model", "llama3-70b", "--num-gpus", "8", "--top", "2", "--json", str(out)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    rows = json.loads(out.read_text())["layouts"]
    least = min(rows, key=lambda r: r["memory_bytes_per_gpu"])
    assert not any(r["fits"] for r in rows)
    assert first.startswith(f"NO LAYOUT FITS: of {len(rows)} layouts the smallest, {least['name']} ")
    assert f"needs {least['memory_bytes_per_gpu'] / 1e9:.1f} GB per GPU > 80.0 GB" in first
    assert main(["plan", "--params", "8e9", "--num-gpus", "8", "--top", "1"]) == 0
    assert "NO LAYOUT FITS" not in capsys.readouterr().out


def test_plan_report_rounding_noise_and_units():
    from llmlab.planner.report import count, seconds
    from llmlab.planner.search import needs

    assert needs(80.04e9, 80e9) == "needs 80.04 GB per GPU > 80.00 GB"  # never "80.0 > 80.0"
    assert needs(80.0004e9, 80e9) == "needs 80.0004 GB per GPU > 80.0000 GB"
    assert needs(166.6e9, 80e9) == "needs 166.6 GB per GPU > 80.0 GB"
    assert [count(n) for n in (230_000, 6.6e6, 8e9, 70.6e9, 1.2e12, 512)] == [
        "230k",
        "6.6M",
        "8B",
        "70.6B",
        "1.2T",
        "512",
    ]
    assert seconds(1.0 + 2e-16 - 1.0, 3.0) == "0" and seconds(0.05, 3.0) == "0.05"
    text = llmlab.plan("tiny", num_gpus=2)
    from llmlab.planner.report import format_table

    assert format_table(text, 1).startswith(f"tiny: {count(text['model']['num_params'])} parameters")
    assert "0.00023B" not in format_table(text, 1)
