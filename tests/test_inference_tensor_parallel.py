"""Tensor-parallel inference (``tensor_parallel_size=2``): two real ranks (gloo), the model's layers
sharded with training's column/row-parallel layers, each rank holding half of the KV heads; the
greedy tokens equal Hugging Face ``generate`` and the single-rank engine's."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # a hard dependency: missing is a failure, not a skip

from llmlab.cli import main
from llmlab.inference import LLM, SamplingParams
from llmlab.inference import tensor_parallel
from llmlab.inference.hf_baseline import hf_greedy

PROMPTS = [[5, 9, 17, 33, 2, 71], [100, 4], list(range(10, 47)), [64] * 17]


def _checkpoint(path):
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        eos_token_id=3,
        bos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


def _hf_greedy(path, prompts, n):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    return hf_greedy(model, prompts, n, eos_token_id=3)


def test_generate_tensor_parallel_2_gives_hf_greedy_tokens(tmp_path):
    path = _checkpoint(tmp_path / "ckpt")
    want = _hf_greedy(path, PROMPTS, 10)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                "--model",
                str(path),
                "--prompts-file",
                str(inp),
                "--temperature",
                "0",
                "--max-tokens",
                "10",
                "--block-size",
                "4",
                "--tensor-parallel-size",
                "2",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    got = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert got == want


def _adapter(path, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
    """A PEFT adapter for the ``shakespeare`` preset with random, non-zero A and B."""
    from llmlab.inference import loader
    from llmlab.model.lora import apply_lora, lora_state, save_peft_adapter

    model = loader.load("shakespeare")[0]
    apply_lora(model, list(targets), 4, 8.0, seed=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora_state(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return save_peft_adapter(
        lora_state(model), path, base="shakespeare", rank=4, alpha=8.0, targets=list(targets)
    )


def _lora_tokens(engine, prompts, loras):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(p, sp, lora=name) for p, name in zip(prompts, loras)]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.get_output(i).outputs[0].token_ids for i in ids]


def test_tensor_parallel_engine_matches_one_rank_and_frees_everything(monkeypatch, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=12, n=2, seed=0)
    prompts = ["ROMEO:", "JULIET: O Romeo", "KING"]
    one = LLM("shakespeare", block_size=4)
    ref = one.generate(prompts, params)
    # LoRA adapters served on 2 ranks (split like training's, llmlab.inference.lora): an adapter's
    # and the base's rows in one step give the one-rank engine's greedy tokens
    adapter, lora_prompts, loras = _adapter(tmp_path / "a"), ["ROMEO:", "ROMEO:", "KING"], ["a", None, "a"]
    one.engine.enable_lora(max_loras=1, max_lora_rank=8)
    one.engine.add_lora("a", adapter)
    want = _lora_tokens(one.engine, lora_prompts, loras)
    assert want[0] != want[1]  # the adapter changes the answer
    llm = LLM(
        "shakespeare", block_size=4, num_gpu_blocks=24, tensor_parallel_size=2, check_invariants=True
    )  # small pool: preemption and copy-on-write on 2 ranks
    runner = llm.engine.runner
    try:
        assert runner.kv_cache.shape[4] == 1  # 2 kv heads over 2 ranks: one each
        assert runner.model.model.layers[0].self_attn.num_heads == 2
        out = llm.generate(prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in out] == [
            [c.token_ids for c in o.outputs] for o in ref
        ]
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert sum(m.num_preemptions for m in llm.engine.step_metrics) > 0
        llm.engine.enable_lora(max_loras=1, max_lora_rank=8)
        llm.engine.add_lora("a", adapter)
        llm.engine.remove_lora("a")  # on every rank (a rank still holding "a" would refuse the next)
        llm.engine.add_lora("a", adapter)
        assert _lora_tokens(llm.engine, lora_prompts, loras) == want
        assert bm.num_free_blocks == bm.num_blocks
        import llmlab.inference.engine as engine_mod  # a failing sampler fails its request alone

        real = engine_mod.sample_token
        monkeypatch.setattr(
            engine_mod,
            "sample_token",
            lambda x, p, g: (_ for _ in ()).throw(ValueError("bad")) if p.seed == 666 else real(x, p, g),
        )
        two = llm.generate(
            prompts[:2],
            [
                SamplingParams(temperature=0.8, max_tokens=12, seed=666),
                SamplingParams(temperature=0, max_tokens=12),
            ],
        )
        assert two[0].outputs[0].finish_reason == "error" and "bad" in two[0].error
        assert two[1].outputs[0].token_ids == ref[1].outputs[0].token_ids
        assert bm.num_free_blocks == bm.num_blocks
        runner.procs[0].kill()  # a rank dies: the next step says which, no hang
        runner.procs[0].join(30)
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            llm.generate(["ROMEO:"], SamplingParams(max_tokens=4))
    finally:
        llm.engine.shutdown()
    assert all(p.exitcode is not None for p in runner.procs)  # the worker rank exited
    assert not torch.distributed.is_initialized()


def test_bad_tensor_parallel_size_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="must divide num_attention_heads=4"):
        LLM("shakespeare", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="quantization"):
        LLM("shakespeare", tensor_parallel_size=2, quantization="int8")
    cfg = LLM("shakespeare").engine.model_config
    tensor_parallel.validate(cfg, 4)  # kv heads replicated: 2 ranks per kv head
    with pytest.raises(ValueError, match="must be >= 1"):
        tensor_parallel.validate(cfg, 0)
