"""The knob sweeps measure what each knob controls (counts and shapes, not timings)."""

import pytest
import torch

from llmlab.inference.knobs import SWEEPS, format_row, knob_workload, sweep


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: a second thread only adds overhead
    yield
    torch.set_num_threads(n)


def test_max_tokens_caps_every_request():
    wl = knob_workload("max_tokens", 4)
    rows = sweep("max_tokens", [None, 3], num_requests=4, warmup=False)
    assert rows[0]["num_output_tokens"] == sum(wl["output_lens"])
    assert rows[1]["num_output_tokens"] == sum(min(3, n) for n in wl["output_lens"]) == 12
    assert rows[1]["num_steps"] < rows[0]["num_steps"]
    assert rows[1]["kv_usage_peak"] <= rows[0]["kv_usage_peak"]


def test_sampling_changes_outputs_not_lengths():
    rows = sweep(
        "sampling",
        [{"temperature": 0.0}, {"temperature": 0.7, "top_k": 1}, {"temperature": 1.0}],
        num_requests=3,
        warmup=False,
        repeats=2,
    )
    greedy, topk1, t1 = rows
    assert [r["label"] for r in rows] == ["greedy", "T=0.7 top_k=1", "T=1.0"]
    assert greedy["same_as_first"] == topk1["same_as_first"] == 1.0  # top_k=1 is greedy
    assert t1["same_as_first"] < 1.0 and t1["distinct_2"] > greedy["distinct_2"]
    assert len({r["num_output_tokens"] for r in rows}) == 1  # same work
    assert all(r["sampling_s_per_step"] > 0 for r in rows)
    assert all(len(r["runs_tok_s"]) == 2 for r in rows)
    assert "distinct-2" in format_row(t1)


def test_max_model_len_rejects_truncates_and_sizes_the_pool():
    wl = knob_workload("max_model_len", 6)
    rows = sweep("max_model_len", [512, 32], num_requests=6, warmup=False)
    full, short = rows
    assert full["rejected"] == full["truncated"] == 0
    assert short["rejected"] == sum(p > 32 for p in wl["prompt_lens"]) > 0
    assert short["truncated"] == sum(p <= 32 < p + o for p, o in zip(wl["prompt_lens"], wl["output_lens"]))
    assert full["num_gpu_blocks"] == 8 * 512 // 16 and short["num_gpu_blocks"] == 8 * 32 // 16


def test_chunked_prefill_caps_the_step():
    rows = sweep("chunked_prefill", [None, 32], num_requests=4, warmup=False)
    off, on = rows
    assert off["max_step_tokens"] > 300 and on["max_step_tokens"] <= 32
    assert off["num_output_tokens"] == on["num_output_tokens"]


def test_max_num_seqs_and_bad_knob():
    rows = sweep("max_num_seqs", [1, 4], num_requests=4, warmup=False)
    assert rows[0]["num_steps"] > rows[1]["num_steps"]  # one at a time: more steps
    assert rows[0]["num_gpu_blocks"] == rows[1]["num_gpu_blocks"] == 48
    with pytest.raises(ValueError, match="unknown knob 'beam'"):
        sweep("beam")
    with pytest.raises(ValueError, match="repeats=0"):
        sweep("max_tokens", repeats=0)
    assert set(SWEEPS) == {"max_tokens", "sampling", "max_model_len", "max_num_seqs", "chunked_prefill"}


def test_benchmark_script_writes_json(tmp_path, capsys):
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_serve_knobs.py"
    spec = importlib.util.spec_from_file_location("bench_serve_knobs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "knobs.json"
    assert (
        mod.main(
            [
                "--knobs",
                "max_tokens",
                "--num-requests",
                "2",
                "--repeats",
                "1",
                "--threads",
                "0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["max_tokens"]
    assert [r["label"] for r in rows] == [
        "max_tokens=natural",
        "max_tokens=64",
        "max_tokens=16",
        "max_tokens=1",
    ]
    assert rows[-1]["num_output_tokens"] == 2 and "vs first row" in capsys.readouterr().out
