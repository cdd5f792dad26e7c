"""Profiler traces per rank with llmlab's phases named (HTA reads them), TensorBoard scalars equal
to the metrics JSON, and the bad inputs of --profile-steps/--profile-dir/--tensorboard."""

from __future__ import annotations

import math

import pytest
import torch

from llmlab.metrics.profiling import parse_steps, phase, trace_path
from llmlab.training.config import TrainConfig, validate
from llmlab.training.trainer import train

TINY = dict(model="tiny", steps=3, global_batch_size=4, seq_len=32, device="cpu")


def hta_names(trace_dir) -> dict[int, set[str]]:
    """rank -> the llmlab phase names (``llmlab.<name>`` without its ``key=value``) HTA finds."""
    from llmlab.tools.trace_analysis import llmlab_phases

    return {r: {"llmlab." + p.name for p in ph} for r, ph in llmlab_phases(trace_dir).items()}


@pytest.fixture(scope="module")
def dp2_pp2_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("prof")
    cfg = TrainConfig(
        dp=2,
        pp=2,
        num_microbatches=2,
        profile_steps="2:3",
        profile_dir=str(root / "traces"),
        tensorboard=str(root / "tb"),
        **TINY,
    )
    metrics = train(cfg, progress=False)
    from llmlab.tools.trace_analysis import llmlab_phases

    return root, metrics, llmlab_phases(root / "traces")  # HTA reads the traces once


def test_dp2_pp2_writes_one_trace_per_rank_with_named_phases(dp2_pp2_run):
    root, _, phases = dp2_pp2_run
    for r in range(4):
        assert trace_path(root / "traces", r).stat().st_size > 1000
    from llmlab.tools.trace_analysis import ddp_overlap, pipeline_idle

    names = {r: {"llmlab." + p.name for p in ph} for r, ph in phases.items()}
    assert sorted(names) == [0, 1, 2, 3]
    for r, ph in phases.items():  # what the analysis helpers read off every rank
        idle, dp = pipeline_idle(ph), ddp_overlap(ph)
        assert 0 < idle["compute_us"] < idle["step_us"] and 0 < idle["idle_fraction"] < 1
        assert dp["steps"] == 2 and dp["buckets"] >= 1 and 0 <= dp["overlap_fraction"] <= 1
    for r, got in names.items():
        # one step of pipeline actions, data-parallel bucket all-reduce with bytes, optimizer
        for want in (
            "llmlab.step",
            "llmlab.forward",
            "llmlab.backward",
            "llmlab.pp p2p",
            "llmlab.p2p",
            "llmlab.ddp bucket all_reduce",
            "llmlab.all_reduce",
            "llmlab.grad sync",
            "llmlab.optimizer",
        ):
            assert want in got, (r, want, sorted(got))


def test_pipeline_p2p_names_its_schedule_actions_and_bucket_bytes(dp2_pp2_run):
    """Each pipeline p2p batch names its schedule actions (``send_act0>1``...); each rank's bucket
    all-reduces carry, in bytes, exactly its stage's gradients (the metrics' ``grads`` memory)."""
    _, metrics, phases = dp2_pp2_run
    grads = {r["rank"]: r["memory_bytes"]["grads"] for r in metrics["ranks"]}
    kinds = {}
    for r, ph in phases.items():
        acts = [a for p in ph if p.name == "pp p2p" for a in p.args["actions"].split(",")]
        kinds[r] = sorted({a.rstrip("0123456789<>") for a in acts})
        for kind in kinds[r]:  # 2 steps x 2 micro-batches, each sent and received once
            assert sum(a.startswith(kind) for a in acts) == 4, (r, acts)
        step2 = [p for p in ph if p.name == "step" and p.args["step"] == "2"][0]
        buckets = [p for p in ph if p.name == "ddp bucket all_reduce" and step2.start <= p.start <= step2.end]
        assert sum(int(p.args["bytes"]) for p in buckets) == grads[r]
        p2p = [p for p in ph if p.name == "p2p"]
        assert p2p and all(int(p.args["bytes"]) > 0 for p in p2p)
    first, last = ["recv_grad", "send_act"], ["recv_act", "send_grad"]
    assert sorted(kinds.values()) == sorted([first, first, last, last])


def test_trace_records_only_the_asked_steps(dp2_pp2_run):
    import gzip
    import json

    root, _, _ = dp2_pp2_run
    trace = json.loads(gzip.open(trace_path(root / "traces", 0)).read())
    steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("llmlab.step "))
    assert steps == ["llmlab.step step=2", "llmlab.step step=3"]
    assert trace["distributedInfo"]["rank"] == 0 and trace["distributedInfo"]["world_size"] == 4


def test_tensorboard_scalars_equal_the_metrics(dp2_pp2_run):
    from llmlab.metrics.tensorboard import read_scalars

    root, metrics, _ = dp2_pp2_run
    got = read_scalars(str(root / "tb"))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"):
        want = [(s["step"], s[key]) for s in metrics["steps"]]
        assert [s for s, _ in got[f"train/{key}"]] == [1, 2, 3]
        for (s, v), (s2, w) in zip(got[f"train/{key}"], want):
            assert s == s2 and math.isclose(v, w, rel_tol=1e-6), key  # float32 in the events
    assert [v for _, v in got["train/skipped"]] == [0.0, 0.0, 0.0]
    for r in metrics["ranks"]:
        for key in ("params", "grads", "optimizer_states", "activations_peak"):
            ((step, v),) = got[f"memory/rank{r['rank']}/{key}"]
            assert step == 3 and math.isclose(v, r["memory_bytes"][key], rel_tol=1e-6)


def test_phase_is_a_no_op_without_profiler():
    assert phase("forward") is phase("backward")  # the one shared nullcontext
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phase("forward", mb=1):
            torch.ones(3).sum()
    assert "llmlab.forward mb=1" in {e.key for e in prof.key_averages()}


@pytest.mark.parametrize(
    "spec,err",
    [("0:2", "within the run's steps 1..3"), ("3:2", "A <= B"), ("2:9", "1..3"), ("a:b", "expected A:B")],
)
def test_bad_profile_steps(spec, err, tmp_path):
    with pytest.raises(ValueError, match="--profile-steps") as e:
        validate(TrainConfig(profile_steps=spec, profile_dir=str(tmp_path), **TINY))
    assert err in str(e.value)
    assert parse_steps("2", 1, 3) == (2, 2)


def test_bad_profile_dir_and_tensorboard(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="--profile-dir .* is a file"):
        validate(TrainConfig(profile_steps="1:1", profile_dir=str(f), **TINY))
    with pytest.raises(ValueError, match="--profile-dir .* cannot be created"):
        validate(TrainConfig(profile_steps="1:1", profile_dir=str(f / "sub"), **TINY))
    with pytest.raises(ValueError, match="--tensorboard .* cannot be created"):
        validate(TrainConfig(tensorboard=str(f / "sub"), **TINY))
    with pytest.raises(ValueError, match="go together"):
        validate(TrainConfig(profile_dir=str(tmp_path), **TINY))


def test_served_run_writes_a_trace_with_named_engine_phases(tmp_path):
    import httpx

    from llmlab.serve import start_server

    with start_server("shakespeare", api_key="traces-key", profile_dir=str(tmp_path), device="cpu") as srv:
        url, key = srv.url, {"Authorization": "Bearer traces-key"}
        assert httpx.post(url + "/start_profile").status_code == 401  # behind the key
        r = httpx.post(url + "/stop_profile", headers=key)
        assert r.status_code == 400 and "no profile is being recorded" in r.text
        assert httpx.post(url + "/start_profile", headers=key).status_code == 200
        assert httpx.post(url + "/start_profile", headers=key).status_code == 400  # already on
        r = httpx.post(
            url + "/v1/completions",
            headers=key,
            json={"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 4},
        )
        assert r.status_code == 200  # unaffected
        traces = httpx.post(url + "/stop_profile", headers=key).json()["traces"]
    assert traces == [str(tmp_path / "engine-1.pt.trace.json.gz")]
    names = hta_names(tmp_path)
    assert names[0] >= {
        "llmlab.engine step",
        "llmlab.schedule",
        "llmlab.prefill",
        "llmlab.decode",
        "llmlab.attention",
        "llmlab.sampling",
    }


def test_engine_profile_without_dir_is_a_clear_error():
    from llmlab.metrics.profiling import TraceRecorder

    with pytest.raises(RuntimeError, match="--profile-dir"):
        TraceRecorder(None).start()
    with pytest.raises(RuntimeError, match="no profile is being recorded"):
        TraceRecorder("/tmp").stop()


def test_serving_gauges_in_tensorboard_equal_the_prometheus_values(tmp_path):
    from llmlab.metrics.tensorboard import read_scalars, write_bench
    from llmlab.serve.metrics import ServerMetrics
    from llmlab.serve.tensorboard import GaugeLogger

    m = ServerMetrics("tiny")
    rep = m.replica("0")
    rep.running.set(3)
    rep.kv_usage.set(0.25)
    rep.on_tokens(7, 5)
    log = GaugeLogger(m, str(tmp_path / "serve"), interval_s=3600)
    first = log.tick()
    rep.running.set(1)
    log.close()  # writes a second sample
    got = read_scalars(str(tmp_path / "serve"))
    assert first["num_requests_running/replica0"] == 3.0
    assert got["serve/num_requests_running/replica0"] == [(0, 3.0), (1, 1.0)]
    assert got["serve/kv_cache_usage_perc/replica0"] == [(0, 0.25), (1, 0.25)]
    assert got["serve/generation_tokens_total/replica0"][-1] == (1, 5.0)
    write_bench(
        [{"request_rate": 2.0, "ttft_p50_s": 0.5}, {"request_rate": 4.0, "ttft_p50_s": 0.75}],
        str(tmp_path / "bench"),
    )
    assert read_scalars(str(tmp_path / "bench"))["bench/ttft_p50_s"] == [(0, 0.5), (1, 0.75)]


def _one_step_trace(tmp_path, model: str, **layout) -> tuple[dict, dict]:
    """Step 1 of a 1-step run of ``layout``, profiled: (rank -> phases as HTA reads them, metrics)."""
    from llmlab.tools.trace_analysis import llmlab_phases

    cfg = TrainConfig(
        **(TINY | dict(model=model, steps=1)), **layout, profile_steps="1:1", profile_dir=str(tmp_path)
    )
    metrics = train(cfg, progress=False)
    return llmlab_phases(tmp_path), metrics


def test_zero3_and_expert_parallel_phases_in_the_trace(tmp_path):
    """ZeRO-3's parameter gathers (in forward and backward) and gradient reduce-scatters, and the
    experts' all-to-all both ways, named on both ranks, each collective with its bytes."""
    phases, _ = _one_step_trace(tmp_path, "tiny-moe", dp=2, ep=2, zero=3)
    assert sorted(phases) == [0, 1]
    for r, ph in phases.items():
        names = {p.name for p in ph}
        assert {"zero all_gather", "zero all_gather wait", "zero reduce_scatter", "all_gather"} <= names
        assert {"reduce_scatter", "ep all_to_all forward", "ep all_to_all backward", "all_to_all"} <= names
        assert {p.args["during"] for p in ph if p.name == "zero all_gather"} == {"forward", "backward"}
        fwd = sum(p.name == "ep all_to_all forward" for p in ph)
        assert fwd == sum(p.name == "ep all_to_all backward" for p in ph) > 0
        for p in ph:
            if p.name in ("all_gather", "reduce_scatter", "all_to_all", "zero reduce_scatter"):
                assert int(p.args["bytes"]) > 0, p
        # the reduce-scatters a bucket launches carry at most its bytes (a bucket of expert weights,
        # whose data-parallel group is one rank here, needs no collective)
        rs = sum(int(p.args["bytes"]) for p in ph if p.name == "reduce_scatter")
        assert 0 < rs <= sum(int(p.args["bytes"]) for p in ph if p.name == "zero reduce_scatter")


def test_ring_attention_steps_in_the_trace(tmp_path):
    """cp=2 ring attention: each layer's ring steps 0..cp-1 named in forward and backward, and its
    K/V block exchanges with their exact bytes."""
    from llmlab.model.config import get_preset

    phases, metrics = _one_step_trace(tmp_path, "tiny", cp=2)
    mc = get_preset("tiny")
    head_dim = mc.hidden_size // mc.num_attention_heads
    # one send and one receive of K and V stacked: 2 ops x 2 x batch x (T / cp) x kv heads x head dim
    kv_bytes = (
        2 * 2 * TINY["global_batch_size"] * (TINY["seq_len"] // 2) * mc.num_key_value_heads * head_dim * 4
    )
    for r, ph in phases.items():
        for way in ("forward", "backward"):
            steps = [p.args["step"] for p in ph if p.name == f"ring_attention {way}"]
            assert sorted(steps) == sorted(["0", "1"] * mc.num_hidden_layers), (r, way, steps)
        ring = [p for p in ph if p.name == "cp_ring_p2p"]
        assert ring and {int(p.args["bytes"]) for p in ring} == {kv_bytes}
        grads = metrics["ranks"][r]["memory_bytes"]["grads"]
        assert sum(int(p.args["bytes"]) for p in ph if p.name == "ddp bucket all_reduce") == grads
