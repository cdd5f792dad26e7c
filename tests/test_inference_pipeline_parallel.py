"""Pipeline-parallel inference (``pipeline_parallel_size=2``, alone and with tensor parallelism 2):
real worker processes (gloo), activations sent stage to stage, up to two steps in flight; greedy
tokens equal the one-process engine's; bad sizes refused before any worker starts; a dead worker
stops the engine with its name, and with replicas the router keeps serving on the live one."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from llmlab.cli import main
from llmlab.inference import LLM, SamplingParams
from llmlab.inference.errors import EngineDeadError
from llmlab.inference.pipeline_parallel import split_layers

PROMPTS = ["ROMEO:", "JULIET: O Romeo", "KING", "First Citizen:\nWe are"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, n=2, seed=0)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference():
    return _tokens(LLM("shakespeare", block_size=4).generate(PROMPTS, PARAMS))


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_parallel_2_gives_the_one_process_greedy_tokens(reference, tp):
    llm = LLM(
        "shakespeare",
        block_size=4,
        num_gpu_blocks=24,
        pipeline_parallel_size=2,
        tensor_parallel_size=tp,
        check_invariants=True,
    )  # small pool: preemption, copy-on-write
    engine = llm.engine
    in_flight = []  # steps already in flight at each submit
    real_submit = engine.runner.submit
    engine.runner.submit = lambda out: (in_flight.append(engine.num_steps_in_flight), real_submit(out))[1]
    try:
        assert _tokens(llm.generate(PROMPTS, PARAMS)) == reference
        assert max(in_flight) == 1  # a step sent while the previous one ran
        assert in_flight.count(1) > len(in_flight) // 2  # most of the time: both stages busy
        assert sum(m.num_preemptions for m in engine.step_metrics) > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        procs = engine.runner.workers.procs
        assert len(procs) == 2 * tp
        procs[-1].kill()  # the last stage's worker dies: no hang, its name
        procs[-1].join(30)
        with pytest.raises(EngineDeadError, match=f"pipeline-parallel rank {2 * tp - 1} exited"):
            llm.generate(["ROMEO:"], SamplingParams(max_tokens=4))
    finally:
        engine.shutdown()
    assert all(p.exitcode is not None for p in procs)
    assert not torch.distributed.is_initialized()


def test_generate_cli_pipeline_parallel(tmp_path, reference):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p, "n": 2}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                "--prompts-file",
                str(inp),
                "--temperature",
                "0",
                "--max-tokens",
                "12",
                "--block-size",
                "4",
                "--pipeline-parallel-size",
                "2",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [[o["token_ids"] for o in r["outputs"]] for r in rows] == reference


def test_bad_pipeline_parallel_size_is_refused_before_any_worker_starts(monkeypatch):
    from llmlab.inference import pipeline_parallel

    started = []
    monkeypatch.setattr(
        pipeline_parallel.ProcessWorkers, "start", classmethod(lambda cls, *a, **k: started.append(a))
    )
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=3 must divide the model's num_hidden_layers=4"
    ):
        LLM("shakespeare", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads"):
        LLM("shakespeare", pipeline_parallel_size=2, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size=0 must be >= 1"):
        LLM("shakespeare", pipeline_parallel_size=0)
    assert started == []
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(SystemExit):  # the CLI names the flag's choices
        main(["generate", "--prompt", "x", "--distributed-executor-backend", "slurm"])


def test_replicas_keep_serving_when_one_replica_dies():
    """Two pipeline-parallel replicas (mp): a worker of one dies; /health says 503, the router
    sends the next requests to the live replica, which answers them."""
    from llmlab.serve import start_server

    with start_server("shakespeare", data_parallel_size=2, pipeline_parallel_size=2, block_size=4) as server:
        body = {"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}
        want = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        dead = server.engines[0]
        dead.engine.runner.workers.procs[0].kill()
        for _ in range(4):  # round robin: one of the next requests finds it dead
            if not dead.is_running:
                break
            httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert not dead.is_running and server.engines[1].is_running
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        for _ in range(3):
            got = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert got.status_code == 200
            assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
