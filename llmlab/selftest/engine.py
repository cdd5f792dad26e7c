"""Self-test checks of the inference engine: greedy tokens against Hugging Face ``generate`` and
the device against the CPU (see :mod:`llmlab.selftest`).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from llmlab.selftest.common import FAIL, PASS, Skip, _gpu
from llmlab.selftest.kernels import _name


# --------------------------------------------------------------------------------------------
# Inference engine
# --------------------------------------------------------------------------------------------
def _random_llama(path: str, vocab: int = 128) -> str:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
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
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _prompts(n: int, vocab: int = 128) -> list[list[int]]:
    import random

    rng = random.Random(0)
    lengths = [1, 2, 15, 16, 17, 31]
    return [[rng.randrange(4, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def check_engine_greedy_vs_hf(quick: bool) -> dict:
    import transformers  # a hard dependency of llmlab

    from llmlab.inference import LLM, SamplingParams
    from llmlab.inference.hf_baseline import hf_greedy

    n, new = (6, 6) if quick else (24, 12)
    with tempfile.TemporaryDirectory() as d:
        path = _random_llama(d)
        prompts = _prompts(n)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        want = hf_greedy(hf, prompts, new, eos_token_id=3)
        llm = LLM(path, device="cpu", dtype=torch.float64, block_size=4)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new))
        got = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for a, b in zip(got, want))
    out = {
        "status": PASS if same == n else FAIL,
        "requests": n,
        "equal": same,
        "detail": f"{same}/{n} requests token-equal to HF generate (fp64, block size 4)",
    }
    if same != n:
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        out["reason"] = f"request {i}: engine {got[i]} vs HF {want[i]}"
    return out


def check_engine_device_vs_cpu(quick: bool) -> dict:
    if not _gpu():
        raise Skip("no CUDA GPU")
    from llmlab.inference import LLM, SamplingParams
    from llmlab.inference.loader import resolve_model_path

    path = str(resolve_model_path("shakespeare"))
    prompts = [[i % 50 + 5] * (1 + i % 7) for i in range(8 if quick else 32)]
    new = 16 if quick else 32
    params = SamplingParams(temperature=0.0, max_tokens=new)
    cpu = [o.outputs[0].token_ids for o in LLM(path, device="cpu").generate(prompts, params)]
    model = _shakespeare_model(path)
    res, worst = {}, None
    for dtype, tol in ((torch.float32, 1e-3), (torch.float16, 2e-2), (torch.bfloat16, 8e-2)):
        gpu = [
            o.outputs[0].token_ids for o in LLM(path, device="cuda", dtype=dtype).generate(prompts, params)
        ]
        checked = equal = 0
        for p, a, b in zip(prompts, cpu, gpu):
            margins = _top2_margins(model, p, a)
            k = next((i for i, m in enumerate(margins) if m <= tol), len(a))  # decided tokens
            checked += k
            if a[:k] != b[:k]:
                worst = worst or f"{_name(dtype)}: prompt {p}: cpu {a[:k]} vs cuda {b[:k]}"
            else:
                equal += k
        res[_name(dtype)] = {"decided_tokens": checked, "equal": equal}
    ok = all(v["decided_tokens"] == v["equal"] for v in res.values())
    out: dict[str, Any] = {
        "status": PASS if ok else FAIL,
        "dtypes": res,
        "detail": ", ".join(
            f"{k} {v['equal']}/{v['decided_tokens']} decided tokens equal" for k, v in res.items()
        ),
    }
    if not ok:
        out["reason"] = worst
    return out


def _shakespeare_model(path):
    from llmlab.inference import loader

    model, _, _ = loader.load(path)
    return model.float().eval()


def _top2_margins(model, prompt, tokens) -> list[float]:
    """CPU fp32 gap between the top two logits before each generated token."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 :].float()  # [new tokens, vocab]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()
