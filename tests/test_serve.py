"""``llmlab bench serve``: workload, metrics, CONTRACT JSON, the equal-output gate, int8 engine."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
import transformers  # noqa: F401  (a hard dependency: missing is a failure, not a skip)

from llmlab.cli import main
from llmlab.inference import bench, workload
from llmlab.inference.metrics import RequestTiming, percentile, summarize


def test_workload_is_seeded_clipped_and_heavy_tailed():
    a = bench.sharegpt_workload(400, seed=3, max_len=512)
    assert a == bench.sharegpt_workload(400, seed=3, max_len=512)
    assert a["prompt_lens"] != bench.sharegpt_workload(400, seed=4, max_len=512)["prompt_lens"]
    assert [len(p) for p in a["prompts"]] == a["prompt_lens"]
    assert all(p >= 4 and o >= 2 and p + o <= 512 for p, o in zip(a["prompt_lens"], a["output_lens"]))
    for lens in (a["prompt_lens"], a["output_lens"]):
        # right-skewed: mean above median, a p99 several times the median
        assert statistics.mean(lens) > statistics.median(lens)
        assert percentile(lens, 99) > 4 * statistics.median(lens)
    assert all(0 <= t < 256 for p in a["prompts"] for t in p)
    with pytest.raises(ValueError, match="num_requests"):
        bench.sharegpt_workload(0)


def test_poisson_arrivals():
    assert bench.poisson_arrivals(5, None) == [0.0] * 5
    t = bench.poisson_arrivals(2000, 10.0, seed=1)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert abs(t[-1] / 1999 - 0.1) < 0.01  # mean gap 1/rate
    with pytest.raises(ValueError, match="request_rate"):
        bench.poisson_arrivals(3, 0.0)


def test_percentiles_and_summary_on_hand_made_example():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)
    assert percentile([7], 99) == 7
    assert percentile(list(range(101)), 37) == 37
    with pytest.raises(ValueError):
        percentile([], 50)
    ts = [
        RequestTiming(0.0, 1.0, 3.0, 5),  # ttft 1, tpot 0.5
        RequestTiming(1.0, 1.5, 4.0, 6),  # ttft 0.5, tpot 0.5
        RequestTiming(2.0, 4.0, 4.0, 1),
    ]  # ttft 2, no tpot
    s = summarize(ts)
    assert s["throughput_tokens_per_s"] == pytest.approx(12 / 4.0)
    assert s["ttft_s"]["p50"] == pytest.approx(1.0)
    assert s["ttft_s"]["p99"] == pytest.approx(1.0 + 0.98 * 1.0)
    assert s["tpot_s"] == {"p50": pytest.approx(0.5), "p99": pytest.approx(0.5)}
    assert s["e2e_s"]["p50"] == pytest.approx(3.0)


KEYS = {"throughput_tokens_per_s", "ttft_s", "tpot_s", "kv_cache_waste_fraction"}


def _check_entry(e, n_tokens):
    assert KEYS <= set(e)
    assert e["throughput_tokens_per_s"] > 0 and e["num_output_tokens"] == n_tokens
    for k in ("ttft_s", "tpot_s"):
        assert set(e[k]) == {"p50", "p99"} and 0 < e[k]["p50"] <= e[k]["p99"] < 60
    assert 0 <= e["kv_cache_waste_fraction"] < 1


@pytest.mark.parametrize("extra", [[], ["--baseline", "hf", "--memory-matched-batch", "2"]])
def test_bench_serve_json_has_contract_keys(tmp_path, extra):
    out = tmp_path / "b.json"
    rc = main(
        [
            "bench",
            "serve",
            "--num-requests",
            "6",
            "--prompt-len-median",
            "12",
            "--output-len-median",
            "6",
            "--json",
            str(out),
        ]
        + extra
    )
    assert rc == 0
    d = json.loads(out.read_text())
    wl = d["workload"]
    assert wl["num_requests"] == 6 and len(wl["prompt_lens"]) == len(wl["output_lens"]) == 6
    _check_entry(d["llmlab"], sum(wl["output_lens"]))
    assert isinstance(d["llmlab"]["num_preemptions"], int) and d["llmlab"]["num_preemptions"] >= 0
    if extra:
        _check_entry(d["hf"], sum(wl["output_lens"]))
        assert "num_preemptions" not in d["hf"] and d["hf"]["batch_size"] == 2
        max_len = max(p + o for p, o in zip(wl["prompt_lens"], wl["output_lens"]))
        assert d["llmlab"]["num_gpu_blocks"] == math.ceil(2 * max_len / 16)
        # the padded static cache wastes more than the paged one
        assert d["hf"]["kv_cache_waste_fraction"] > d["llmlab"]["kv_cache_waste_fraction"]
        assert d["hf"]["outputs_vs_llmlab"]["requests_equal"] == 6
        # transformers' own continuous batching, same blocks, same greedy tokens (measured: all)
        if bench.hf_continuous_available(bench.load_hf(bench_model_path())) is None:
            cb = d["hf_continuous"]
            assert {"throughput_tokens_per_s", "ttft_s", "tpot_s"} <= set(cb)
            assert cb["throughput_tokens_per_s"] > 0 and cb["num_output_tokens"] == sum(wl["output_lens"])
            assert cb["num_gpu_blocks"] == d["llmlab"]["num_gpu_blocks"]
            assert cb["kv_cache_bytes"] == d["llmlab"]["kv_cache_bytes"]
            assert cb["gate_vs_llmlab"]["requests_equal"] == cb["gate_vs_llmlab"]["num_requests"] == 4
            assert cb["outputs_vs_llmlab"] == {
                "requests_equal": 6,
                "num_requests": 6,
                "tokens_equal": sum(wl["output_lens"]),
                "num_tokens": sum(wl["output_lens"]),
                "first_difference": None,
            }
        else:
            assert "hf_continuous" not in d and d["hf_continuous_skipped"]
        assert d["config"]["num_threads"] == 1
    else:
        assert "hf" not in d


def bench_model_path():
    from llmlab.inference.loader import resolve_model_path

    return resolve_model_path("shakespeare")


def test_compare_outputs_counts_requests_and_tokens():
    c = bench.compare_outputs([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [6, 7]])
    assert c == {
        "requests_equal": 1,
        "num_requests": 3,
        "tokens_equal": 5,
        "num_tokens": 7,
        "first_difference": [1, 1],
    }


def test_hf_continuous_skipped_with_reason_where_unavailable():
    class Old:  # a model without init_continuous_batching
        pass

    assert "no continuous batching" in bench.hf_continuous_available(Old())


def test_hf_sweep_with_poisson_arrivals_reports_best_batch():
    r = bench.bench_serve(
        num_requests=5,
        request_rate=50.0,
        baseline="hf",
        prompt_len_median=8,
        output_len_median=4,
        hf_batch_sizes=(2, 8),
        check=False,
        hf_continuous=False,
        repeats=2,
    )
    sweep = r["hf"]["sweep"]
    assert len(r["llmlab"]["throughput_runs"]) == len(r["hf"]["throughput_runs"]) == 2
    assert r["llmlab"]["throughput_tokens_per_s"] == max(r["llmlab"]["throughput_runs"])  # upper median of 2
    runs = [{"throughput_tokens_per_s": t, "i": i} for i, t in enumerate([5.0, 1.0, 3.0])]
    assert bench._median_run(runs)["i"] == 2 and bench._median_run(runs)["throughput_runs"] == [5.0, 1.0, 3.0]
    assert [s["batch_size"] for s in sweep] == [2, 5]
    assert r["hf"]["throughput_tokens_per_s"] == max(s["throughput_tokens_per_s"] for s in sweep)
    assert r["config"]["request_rate"] == 50.0


def test_hf_kv_waste_matches_hand_count():
    class Fake:  # stands in for HF: no model maths involved
        def parameters(self):
            yield torch.zeros(1)

        def generate(self, input_ids, max_new_tokens, streamer, **kw):
            streamer.put(input_ids)
            for _ in range(max_new_tokens):
                streamer.put(None)
            return torch.cat([input_ids, torch.zeros(len(input_ids), max_new_tokens, dtype=torch.long)], 1)

    wl = {"prompts": [[1, 2], [1, 2, 3, 4]], "prompt_lens": [2, 4], "output_lens": [2, 1]}
    r = bench.run_hf(Fake(), wl, [0.0, 0.0], batch_size=2)
    # cache 2 rows x (4 + 2); after step 1 holds 3 + 5 tokens, after step 2 holds 4 + 5
    assert r["kv_cache_waste_fraction"] == pytest.approx(((1 - 8 / 12) + (1 - 9 / 12)) / 2)


def test_equal_output_gate_catches_a_different_model(tmp_path):
    from llmlab.inference.loader import resolve_model_path
    from llmlab.model.hf import load_hf_model, save_hf_checkpoint

    path = resolve_model_path("shakespeare")
    hf = bench.load_hf(path)
    wl = bench.sharegpt_workload(3, seed=1, prompt_len_median=10, output_len_median=6)
    bench.check_equal_outputs(str(path), hf, wl, num=3)  # same weights: passes
    other = load_hf_model(path)
    with torch.no_grad():
        other.lm_head.weight.copy_(torch.roll(other.lm_head.weight, 1, dims=0))
    save_hf_checkpoint(other, tmp_path / "m")
    with pytest.raises(RuntimeError, match="greedy tokens differ"):
        bench.check_equal_outputs(str(tmp_path / "m"), hf, wl, num=3)


def test_engine_int8_weights_bytes_perplexity_and_greedy_tokens():
    from llmlab.data import ByteTokenizer, load_corpus
    from llmlab.inference import LLM, SamplingParams
    from llmlab.model.quantize import Int8Linear, linear_weight_bytes, perplexity

    with pytest.raises(ValueError, match="quantization"):
        LLM("shakespeare", device="cpu", quantization="int4", num_gpu_blocks=8)
    fp = LLM("shakespeare", device="cpu", num_gpu_blocks=16)
    q8 = LLM("shakespeare", device="cpu", num_gpu_blocks=16, quantization="int8")
    m_fp, m_q = fp.engine.runner.model, q8.engine.runner.model
    cfg = m_fp.config
    rows = sum(m.out_features for m in m_q.modules() if isinstance(m, Int8Linear))
    assert sum(isinstance(m, Int8Linear) for m in m_q.modules()) == 7 * cfg.num_hidden_layers
    head = cfg.vocab_size * cfg.hidden_size * 4  # lm_head stays fp32
    before, after = linear_weight_bytes(m_fp), linear_weight_bytes(m_q)
    assert after == (before - head) // 4 + 4 * rows + head  # measured 3.28 MB -> 0.94 MB
    tokens = torch.tensor(ByteTokenizer().encode(load_corpus()[-20000:]))
    ppl, ppl_q = (perplexity(m, tokens, seq_len=64, max_windows=4) for m in (m_fp, m_q))
    assert abs(ppl_q - ppl) / ppl < 0.01  # measured ~0.01% change
    sp = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["ROMEO:", "KING HENRY:"]
    a = [o.outputs[0].token_ids for o in fp.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in q8.generate(prompts, sp)]
    same = sum(x == y for ta, tb in zip(a, b) for x, y in zip(ta, tb)) / sum(map(len, a))
    assert same >= 0.9  # measured 1.0 (all equal)


def test_kv_waste_is_last_block_fragmentation_and_matches_the_engine():
    # lengths 5 and 16 in blocks of 4: 8 + 16 slots allocated, 21 hold a token
    assert workload.kv_waste([5, 16], 4) == pytest.approx(1 - 21 / 24)
    assert workload.kv_waste([5, 16], 1) == 0.0 and workload.kv_waste([], 16) == 0.0
    # prompts 3 and 2, outputs 3 and 1: after step 1 both prompts cached, then 4 tokens of the first
    assert workload.concurrent_trace([3, 2], [3, 1]) == [[3], [4]]
    wl = bench.sharegpt_workload(6, seed=2, prompt_len_median=10, output_len_median=8)
    r = bench.run_llmlab(str(bench_model_path()), wl, [0.0] * 6, block_size=4)
    # the engine allocates nothing ahead: its measured waste is exactly the last-block fragmentation
    # of the sequences it holds, which is what the concurrent trace predicts offline
    assert r["kv_cache_waste_fraction"] == pytest.approx(r["kv_waste_by_block_size"]["4"])
    assert r["kv_cache_waste_fraction"] == pytest.approx(
        workload.trace_waste(workload.concurrent_trace(wl["prompt_lens"], wl["output_lens"]), 4)
    )
    w = [r["kv_waste_by_block_size"][str(b)] for b in bench.WASTE_BLOCK_SIZES]
    assert w[0] == 0.0 and all(a <= b for a, b in zip(w, w[1:]))


def test_runner_fuses_projections_over_views_of_one_weight():
    from llmlab.inference import LLM, SamplingParams

    llm = LLM("shakespeare", device="cpu", num_gpu_blocks=32)
    runner = llm.engine.runner
    layer = runner.model.model.layers[0]
    a = layer.self_attn
    w, b, split = a.fused_qkv
    assert split == [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
    # no copy: the modules' weights are views of the fused tensor
    assert a.q_proj.weight.data_ptr() == w.data_ptr()
    assert a.v_proj.weight.data_ptr() == w[split[0] + split[1] :].data_ptr()
    assert (
        layer.mlp.up_proj.weight.data_ptr()
        == layer.mlp.fused_gate_up[0][layer.mlp.gate_proj.out_features :].data_ptr()
    )
    # a step mixing prompts and decodes gives each sequence the tokens it gets alone
    sp = SamplingParams(temperature=0, max_tokens=6)
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in ("ROMEO:", "KING HENRY IV:")]
    eng = llm.engine
    eng.add_request("ROMEO:", sp, request_id="a")
    eng.step()  # a: prompt; next step a decodes while b prefills
    eng.add_request("KING HENRY IV:", sp, request_id="b")
    assert (
        eng.step()
        and eng.step_metrics[-1].num_prefill_tokens == len("KING HENRY IV:")
        and eng.step_metrics[-1].num_seqs == 2
    )
    while eng.has_unfinished_requests():
        eng.step()
    assert [eng.get_output(r).outputs[0].token_ids for r in "ab"] == alone
    q8 = LLM("shakespeare", device="cpu", num_gpu_blocks=8, quantization="int8")
    assert (
        q8.engine.runner.model.model.layers[0].self_attn.fused_qkv is None
    )  # int8 modules are kept as they are


def test_runner_buckets_split_only_when_padding_costs_more_than_a_call():
    from llmlab.inference.padding_buckets import buckets as _buckets
    from llmlab.inference.sequence import Sequence

    def decode(ctx):
        s = Sequence("r", list(range(ctx)), None)
        s.num_computed_tokens = ctx - 1
        return (s, 1)

    few = [decode(c) for c in (10, 200, 20)]
    assert [len(b) for b in _buckets(few)] == [3]  # 3 x 200 x 17 < one more call
    many = [decode(c) for c in [20] * 60 + [400] * 4]
    parts = _buckets(many)
    # sorted by context, the 60 short ones apart from the 4 long ones
    assert [len(b) for b in parts] == [60, 4]
    assert sorted(s.num_computed_tokens + 1 for s, _ in parts[0]) == [20] * 60


def test_warm_up_uses_the_timed_engine_settings(monkeypatch, tmp_path):
    """Triton compiles a kernel per specialisation (block size, query tile): a warm-up with other
    settings left the compilation inside the timed run."""
    calls = []
    real = bench.run_llmlab
    monkeypatch.setattr(bench, "run_llmlab", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    rc = main(
        [
            "bench",
            "serve",
            "--num-requests",
            "3",
            "--prompt-len-median",
            "8",
            "--output-len-median",
            "4",
            "--block-size",
            "4",
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    assert rc == 0 and len(calls) == 2
    warm, timed = calls
    for key in ("block_size", "num_gpu_blocks", "max_num_seqs", "quantization", "device"):
        assert warm[key] == timed[key], key


def test_paged_attention_variants_compile_ahead():
    import os
    from llmlab.kernels import TRITON_MARKER, triton_platform

    if not triton_platform():  # by platform, as the kernels extra installs triton: never by import
        pytest.skip(f"the kernels extra has no triton for this platform ({TRITON_MARKER})")
    from llmlab.kernels import paged_attention as kpa

    if not torch.cuda.is_available() and not kpa.INTERPRETED:
        pytest.fail("TRITON_INTERPRET=1 must be set before triton is imported (root conftest)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert os.environ.get("TRITON_INTERPRET") or dev == "cuda"
    assert kpa.compile_variants(4, 2, 16, 4, torch.float32, dev, block_n=16) == 4
