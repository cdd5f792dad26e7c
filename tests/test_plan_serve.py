"""``llmlab plan --serve`` and ``--articles`` (issue 41): the serving cost model's arithmetic, the
source articles' figures computed, bad input refused by name, and the CLI."""

from __future__ import annotations

import json

import pytest

from llmlab.cli import main
from llmlab.formulas.serving import (
    blocks_for,
    gpus_for_bytes,
    kv_bytes_per_token,
    kv_pool_blocks,
    max_concurrency,
    paged_vs_contiguous,
)
from llmlab.planner import articles
from llmlab.planner.serve_api import plan_serve
from llmlab.planner.serve_spec import SERVE_MODELS, ServeWorkload, serve_model_from_hf_config

GB = 1e9


def test_kv_formulas():
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x bf16 x (K, V) = 128 KiB per token
    assert kv_bytes_per_token(32, 8, 128, 2) == 131072
    assert kv_bytes_per_token(32, 8, 128, 2, tp=4, pp=2) == 131072 / 8
    with pytest.raises(ValueError, match="tp=3 does not divide the model's 8 KV heads"):
        kv_bytes_per_token(32, 8, 128, 2, tp=3)
    assert blocks_for(10240, 16) == 640 and blocks_for(10241, 16) == 641
    assert kv_pool_blocks(1000 * 16 * 100 + 99, 100, 16) == 1000
    assert kv_pool_blocks(-5.0, 100, 16) == 0
    assert max_concurrency(1281, 16, 32) == 640 and max_concurrency(1281, 16, 33) == 427
    assert gpus_for_bytes(175e9 * 4, 80e9) == 9
    with pytest.raises(ValueError, match="gpu_memory_bytes must be > 0"):
        gpus_for_bytes(1.0, 0)


def test_paged_vs_contiguous_counts_blocks():
    r = paged_vs_contiguous([1, 16, 17], 64, 10.0, block_size=16)
    assert r["contiguous_bytes"] == 3 * 64 * 10 and r["paged_bytes"] == (1 + 1 + 2) * 16 * 10
    assert r["paged_utilisation"] == pytest.approx(34 / 64)
    with pytest.raises(ValueError, match="reserve_len"):
        paged_vs_contiguous([65], 64, 10.0)


def test_article_10240_gives_128():
    """Qwen2.5-72B bf16, TP8 on 8 x A800-80GB: 128 sequences of 10,240 at utilisation 0.915,
    125 at vLLM's default 0.9, and only 38 at the model's own 32,768-token context."""
    assert articles.concurrency_10240(0.915)["max_concurrency"] == 128
    assert articles.concurrency_10240(0.9)["max_concurrency"] == 125
    assert articles.concurrency_10240(0.915, 32768)["max_concurrency"] == 38


def test_article_paged_72b_plus_300_percent_and_halved():
    p = articles.paged_72b()
    assert p["kv_bytes_per_token"] == 327680 and p["mean_len"] == 8192
    assert p["utilisation_gain"] == pytest.approx(3.0)  # "+300%"
    assert p["total_ratio"] == pytest.approx(0.5, abs=0.01)  # weights + KV "halved"
    assert p["kv_ratio"] == pytest.approx(0.25)


def test_article_8b_activations_and_total():
    a = articles.activations_8b()
    assert round(a["total_bytes"] / GB) == 224 and round(a["model_states"]["total"] / GB) == 128
    assert a["power_of_two_shapes_giving_target"] == []  # the honest statement
    assert 3800 < a["seq_len_for_target_at_b1"] < 4096
    assert round(a["grid_bytes"]["b=1 s=4096"] / GB) == 104


def test_article_175b_cards():
    g = articles.gpus_175b()
    assert g == {"2 B/param": 5, "4 B/param": 9, "10 B/param": 22, "16 B/param": 35}


def test_7b_recommends_instances_and_72b_tp_inside_a_node():
    r7 = plan_serve("qwen2.5-7b", cluster="a800", num_gpus=8, workload=ServeWorkload(max_model_len=10240))
    top = r7["layouts"][0]
    assert (top["tp"], top["pp"], top["replicas"]) == (1, 1, 8)
    assert "add instances rather than tensor or pipeline parallelism" in r7["recommendation"]
    tp2 = next(r for r in r7["layouts"] if (r["tp"], r["pp"]) == (2, 1))
    assert tp2["tpot_s"] < top["tpot_s"] and tp2["tokens_per_s_per_gpu"] < top["tokens_per_s_per_gpu"]
    r72 = plan_serve(
        "qwen2.5-72b",
        cluster="a800",
        num_gpus=16,
        workload=ServeWorkload(max_model_len=10240, concurrency=64),
    )
    best = r72["layouts"][0]
    assert best["fits"] and best["tp"] == 8 and best["replicas"] == 2
    assert "inside a node" in r72["recommendation"]
    no = {r["name"]: r["why_not"] for r in r72["layouts"] if not r["fits"]}
    assert "TP16 does not divide the 8 KV heads" in no["TP16 x PP1 x 1 instance"]
    assert "exceed the 0.9 x 80 GB" in no["TP1 x PP1 x 16 instances"]


def test_tp_wins_at_light_load_and_instances_when_busy():
    def at(n):
        r = plan_serve(
            "qwen2.5-7b",
            cluster="a800",
            num_gpus=8,
            workload=ServeWorkload(prompt_len=1024, output_len=256, max_model_len=10240, concurrency=n),
        )
        rows = {(x["tp"], x["pp"]): x for x in r["layouts"] if x["fits"]}
        return rows[(1, 1)], rows[(2, 1)], r["recommendation"]

    one, two, rec = at(32)
    assert two["tokens_per_s_per_gpu"] > one["tokens_per_s_per_gpu"] and two["tpot_s"] < one["tpot_s"]
    assert "at this load" in rec and "memory-bound" in rec
    one, two, rec = at(2048)
    assert one["meets_load"] and not two["meets_load"]
    assert "add instances rather than tensor or pipeline parallelism" in rec


def test_roofline_grows_with_batch_and_context():
    base = dict(cluster="h100", num_gpus=1)
    t = {
        (c, p): plan_serve(
            "llama3-8b",
            **base,
            workload=ServeWorkload(prompt_len=p, output_len=64, max_model_len=8192, concurrency=c),
        )["layouts"][0]["tpot_s"]
        for c in (1, 32)
        for p in (512, 4096)
    }
    assert t[(1, 512)] < t[(32, 512)] < t[(32, 4096)] and t[(1, 512)] < t[(1, 4096)]
    w8 = 8.03e9 * 2 / 3.35e12  # weights alone at 3.35 TB/s
    assert w8 < t[(1, 512)] < 1.1 * w8


def test_hf_config_gqa_head_dim_sliding_and_refusals(tmp_path):
    cfg = dict(
        model_type="qwen2",
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
        head_dim=32,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        max_position_embeddings=256,
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = serve_model_from_hf_config(tmp_path)
    assert (m.kv_heads, m.head_dim, m.sliding_layers, m.sliding_window) == (2, 32, 3, 8)
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        serve_model_from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        serve_model_from_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="--config"):
        serve_model_from_hf_config(tmp_path / "nothere.json")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu-memory-gb", "0"], "--gpu-memory-gb must be > 0"),
        (["--gpu-memory-gb", "-3"], "--gpu-memory-gb must be > 0"),
        (["--max-model-len", "100", "--prompt-len", "200"], "exceed --max-model-len 100"),
        (["--kv-dtype", "int3"], "--kv-dtype 'int3'"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--gpu-memory-gb", "nan"], "--gpu-memory-gb must be a finite number, got nan"),
        (["--concurrency", "0"], "--concurrency must be an integer >= 1"),
        (["--max-model-len", "65536"], "larger than qwen2.5-7b's context"),
        (["--hbm-bw-gb-s", "-1"], "--hbm-bw-gb-s must be > 0"),
        (["--hbm-bw-gb-s", "0"], "--hbm-bw-gb-s must be > 0"),
        (["--achievable-fraction", "0"], "--achievable-fraction must be > 0"),
        (["--validate"], "with --serve use --calibrate"),
    ],
)
def test_cli_bad_input_names_the_flag(argv, message, capsys):
    assert main(["plan", "--serve", "--model", "qwen2.5-7b", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_does_not_fit_row_and_exit_status(capsys):
    # 72B in bf16 on one 80 GB GPU: a "does not fit, because" row, exit status 1, no traceback
    assert main(["plan", "--serve", "--model", "qwen2.5-72b", "--num-gpus", "1"]) == 1
    out = capsys.readouterr().out
    assert "does not fit: TP1 x PP1 x 1 instance, because weights 145.4 GB" in out
    # KV of one sequence of max-model-len does not fit: 8B on a 24 GB GPU at 128k context
    assert (
        main(
            [
                "plan",
                "--serve",
                "--model",
                "llama3-8b",
                "--num-gpus",
                "1",
                "--gpu-memory-gb",
                "24",
                "--max-num-batched-tokens",
                "8192",
                "--max-model-len",
                "131072",
            ]
        )
        == 1
    )
    assert "less than one sequence of max-model-len 131,072" in capsys.readouterr().out


def test_cli_serve_json_and_articles(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert (
        main(["plan", "--serve", "--model", "qwen2.5-7b", "--max-model-len", "10240", "--json", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "add instances rather than tensor or pipeline parallelism" in text
    res = json.loads(out.read_text())
    assert res["layouts"][0]["name"] == "TP1 x PP1 x 8 instances"
    assert res["layouts"][0]["kv_bytes_per_token"] == 57344  # Qwen2.5-7B: 28 x 4 x 128 x 2 x 2
    assert main(["plan", "--articles"]) == 0
    text = capsys.readouterr().out
    for s in ("0.915: 128", "(+300%)", "(x0.50)", "= 224 GB", "10 B/param -> 22 cards"):
        assert s in text
    assert main(["estimate", "--params", "175e9", "--dtype", "fp32", "--gpu-memory-gb", "80"]) == 0
    assert "9 for the parameters" in capsys.readouterr().out


def test_presets_param_counts():
    # published totals: Qwen2.5-7B 7.62B, Qwen2.5-72B 72.7B, Llama-3-8B 8.03B, Llama-3-70B 70.6B
    for name, n in (
        ("qwen2.5-7b", 7.62e9),
        ("qwen2.5-72b", 72.7e9),
        ("llama3-8b", 8.03e9),
        ("llama3-70b", 70.6e9),
    ):
        assert SERVE_MODELS[name].num_params == pytest.approx(n, rel=0.005)


def test_llmlab_plan_serve_true_and_a_request_rate():
    import llmlab

    w = ServeWorkload(prompt_len=512, output_len=128, max_model_len=4096, request_rate=10.0)
    res = llmlab.plan("llama3-8b", serve=True, cluster="h100", num_gpus=2, workload=w)
    top = res["layouts"][0]
    assert top["fits"] and top["meets_load"]
    assert top["tokens_per_s"] == pytest.approx(10.0 * 128, rel=0.1)  # what the rate asks for
    over = llmlab.plan_serve(
        "llama3-8b",
        cluster="h100",
        num_gpus=1,
        workload=ServeWorkload(prompt_len=512, output_len=128, max_model_len=4096, request_rate=1e5),
    )["layouts"][0]
    assert not over["meets_load"] and over["batch_per_instance"] == over["concurrency_at_workload"]
