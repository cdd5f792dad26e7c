"""The serving planner against llmlab's engine (issue 41): the KV pool and the concurrency it
predicts equal the engine's own, exactly, at the same block size and memory, on the shipped model
and on Hugging Face Llama (explicit head_dim) and Qwen2 (GQA, sliding window) checkpoints; the
decode step-time model orders two far-apart points as the engine measures them."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmlab.inference.loader import shipped_model_dir
from llmlab.planner.serve_spec import serve_model_from_hf_config
from llmlab.planner.serve_validate import (
    calibrate_serving,
    engine_kv_pool,
    measure_decode_step,
    predict_decode_step,
    predicted_kv_pool,
    spearman,
)

COMMON = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=None,
    bos_token_id=1,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("serve_hf")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, head_dim=32))
    llama.save_pretrained(str(root / "llama"))
    qwen = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            **COMMON,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=1,
            tie_word_embeddings=False,
        )
    )
    qwen.save_pretrained(str(root / "qwen2"))
    return {
        "shakespeare": str(shipped_model_dir("shakespeare")),
        "llama": str(root / "llama"),
        "qwen2": str(root / "qwen2"),
    }


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("name", ["shakespeare", "llama", "qwen2"])
def test_kv_pool_and_concurrency_equal_the_engine(checkpoints, name, block_size):
    path, budget, max_len, seq_len = checkpoints[name], 600_000 + 12_345, 200, 77
    engine = engine_kv_pool(path, block_size, budget, max_len, seq_len)
    model = serve_model_from_hf_config(path)
    assert model.to_dict() | {"name": ""} == engine["model"].to_dict() | {
        "name": "",
        "max_position": model.max_position,
    }  # the same shape read two ways
    pred = predicted_kv_pool(model, block_size, budget, max_len, seq_len)
    assert pred["num_blocks"] == engine["num_blocks"]
    assert pred["kv_tokens"] * pred["kv_bytes_per_token"] == engine["kv_cache_bytes"]
    assert pred["concurrency_max_len"] == engine["concurrency_max_len"] >= 1
    assert pred["concurrency_seq_len"] == engine["concurrency_seq_len"] > engine["concurrency_max_len"]


def test_one_sequence_that_does_not_fit_is_a_row_not_a_crash(checkpoints):
    model = serve_model_from_hf_config(checkpoints["shakespeare"])
    pred = predicted_kv_pool(model, 16, 10_000, 256)
    assert not pred["fits"] and pred["num_blocks"] < 16


def test_decode_step_model_orders_far_apart_points():
    """Calibrated with this machine's bandwidth and FLOP/s; two points 100x apart in KV read
    (the lab and benchmarks/bench_plan_serve.py report the Spearman correlation over six)."""
    here = calibrate_serving(0.1)
    assert here["hbm_bandwidth"] > 1e8 and here["flop_rate"] > 1e8
    small, big = (1, 32), (32, 128)
    assert predict_decode_step(here, *big) > predict_decode_step(here, *small)
    assert measure_decode_step(*big) > measure_decode_step(*small)
    assert spearman([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(0.8)
