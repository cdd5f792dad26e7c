"""The serving dashboard records what the engine did, step by step and request by request."""

import pytest

from llmlab.inference import LLMEngine, SamplingParams
from llmlab.inference.metrics import p50_p99
from llmlab.viz.serving import PANELS, ServingDashboard


@pytest.fixture(scope="module")
def served():
    # 6 requests, 4 sequences at most, a pool of 5 blocks of 4 tokens: requests queue, join,
    # finish at different steps, and the pool runs full (preemption by recompute).
    eng = LLMEngine("shakespeare", max_num_seqs=4, block_size=4, num_gpu_blocks=5, device="cpu")
    lens = [2, 7, 3, 5, 2, 4]
    for i, n in enumerate(lens):
        eng.add_request(
            [65 + i] * (3 + i % 3),
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
            request_id=f"r{i}",
        )
    dash = ServingDashboard(interval=0.0)
    while eng.has_unfinished_requests():
        outs = eng.step()
        dash.update(eng.step_metrics[-1], outs)
        dash.update(eng.step_metrics[-1], outs)  # a repeated step/output is recorded once
    dash.finish()
    return eng, dash, lens


def test_steps_match_engine(served):
    eng, dash, _ = served
    sm = eng.step_metrics
    assert [s["step"] for s in dash.steps] == [m.step for m in sm]
    assert [s["num_running"] for s in dash.steps] == [m.num_running for m in sm]
    assert [s["num_waiting"] for s in dash.steps] == [m.num_waiting for m in sm]
    assert [s["num_batched_tokens"] for s in dash.steps] == [m.num_batched_tokens for m in sm]
    assert [s["kv_usage"] for s in dash.steps] == [m.kv_blocks_used / m.kv_blocks_total for m in sm]
    assert dash.steps[0]["num_waiting"] == 2  # 6 requests, max_num_seqs=4
    assert dash.summary()["num_preemptions"] == sum(m.num_preemptions for m in sm) > 0
    assert dash.summary()["max_kv_usage"] == 1.0


def test_finished_requests_and_percentiles(served):
    eng, dash, lens = served
    assert sorted(r["request_id"] for r in dash.finished) == [f"r{i}" for i in range(6)]
    outs = {rid: eng.get_output(rid) for rid in eng.requests}
    for r in dash.finished:
        m = outs[r["request_id"]].metrics
        assert r["ttft_s"] == m.ttft > 0 and r["tpot_s"] == m.tpot
        assert r["num_output_tokens"] == lens[int(r["request_id"][1:])]
    steps = [r["step"] for r in dash.finished]
    assert steps == sorted(steps) and steps[-1] == eng.step_metrics[-1].step
    s = dash.summary()
    assert s["ttft_s"] == p50_p99(o.metrics.ttft for o in outs.values())
    assert s["tpot_s"] == p50_p99(o.metrics.tpot for o in outs.values())
    assert s["ttft_s"]["p99"] > s["ttft_s"]["p50"]  # queued requests waited longer


def test_panels_show_the_data(served):
    _, dash, _ = served
    ax = dash.axes[PANELS["ttft"]]
    ys = sorted(round(y, 9) for y in ax.get_lines()[0].get_ydata())
    assert ys == sorted(round(1e3 * r["ttft_s"], 9) for r in dash.finished)
    p = dash.summary()["ttft_s"]
    hlines = {ln.get_label().split()[0]: ln.get_ydata()[0] for ln in ax.get_lines()[1:]}
    assert hlines["p50"] == pytest.approx(1e3 * p["p50"]) and hlines["p99"] == pytest.approx(1e3 * p["p99"])
    seqs = dash.axes[PANELS["seqs"]]
    assert [ln.get_label() for ln in seqs.get_lines()] == ["running", "waiting"]
