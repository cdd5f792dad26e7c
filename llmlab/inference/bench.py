"""``llmlab bench serve``: the engine against Hugging Face static-batch ``generate``.

Both systems serve the same seeded ShareGPT-like workload (:func:`sharegpt_workload`: heavy-tailed
prompt and output lengths) on the same weights, greedy, each request producing exactly its output
length (``ignore_eos`` here; ``min_new_tokens = max_new_tokens`` there). Before anything is timed
the greedy tokens of both systems are checked equal on a few requests (:func:`check_equal_outputs`).

- llmlab: requests enter the engine at their arrival times (all at t=0 offline, Poisson arrivals
  at ``--request-rate``); continuous batching over the paged cache (Orca, Yu et al. 2022;
  PagedAttention, Kwon et al. 2023 §6 runs the same comparison against static batching).
- HF: requests in arrival order, batches of B, left padding; a batch starts when its last request
  has arrived and the previous batch is done, and runs ``max(output lengths)`` decode steps.
  Token times come from a ``generate`` streamer (as if streamed to the user, HF's best case).
  KV waste of a batch at decode step t is the share of the padded cache (rows x (longest prompt +
  longest output)) holding no token of its request; averaged over steps like the engine's.
- ``--memory-matched-batch B``: both get the KV bytes of B sequences at the workload's maximum
  length: HF runs batches of B; llmlab gets ``num_gpu_blocks = ceil(B * max_len / block_size)``.
  Without it HF sweeps batch sizes (8, 16, 32, 64) and its best throughput is reported.

JSON written to ``--json``: see CONTRACT ``llmlab bench`` (plus extra keys ``e2e_s``,
``duration_s``, ``num_output_tokens``, ``config`` and, for HF, ``batch_size`` and ``sweep``).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from llmlab.inference.metrics import RequestTiming, summarize

HF_BATCH_SIZES = (8, 16, 32, 64)


# --- workload ------------------------------------------------------------------------------------
def sharegpt_workload(num_requests: int, *, seed: int = 0, max_len: int = 512,
                      prompt_len_median: float = 32.0, output_len_median: float = 32.0,
                      sigma: float = 0.9, vocab_size: int = 256) -> dict:
    """A seeded ShareGPT-like workload: lognormal prompt and output lengths (median
    ``*_median`` tokens, shape ``sigma``: a heavy right tail, as the ShareGPT conversations vLLM
    benchmarks with), clipped so that prompt >= 4, output >= 2 and prompt + output <= ``max_len``.

    Prompts are consecutive bytes of the bundled corpus (byte vocabulary) or uniform token ids.
    Returns ``{"prompts": [[ids]], "prompt_lens": [...], "output_lens": [...]}``.
    Raises ``ValueError`` if ``num_requests < 1`` or ``max_len < 6``."""
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    if max_len < 6:
        raise ValueError(f"max_len={max_len} must be >= 6 (4 prompt + 2 output tokens)")
    rng = random.Random(seed)
    corpus = None
    if vocab_size == 256:
        from llmlab.data import load_corpus
        corpus = load_corpus().encode("utf-8")
    prompts, plens, olens = [], [], []
    for _ in range(num_requests):
        p = int(round(rng.lognormvariate(math.log(prompt_len_median), sigma)))
        p = max(4, min(p, max_len // 2))
        o = int(round(rng.lognormvariate(math.log(output_len_median), sigma)))
        o = max(2, min(o, max_len - p))
        if corpus is not None:
            s = rng.randrange(0, len(corpus) - p)
            ids = list(corpus[s:s + p])
        else:
            ids = [rng.randrange(vocab_size) for _ in range(p)]
        prompts.append(ids)
        plens.append(p)
        olens.append(o)
    return {"prompts": prompts, "prompt_lens": plens, "output_lens": olens}


def poisson_arrivals(num_requests: int, request_rate: float | None, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds: all 0 when ``request_rate`` is None or inf (offline), else a
    Poisson process of ``request_rate`` requests/s (exponential gaps), first at 0."""
    if request_rate is None or math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"request_rate={request_rate} must be > 0")
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for i in range(num_requests):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


# --- llmlab --------------------------------------------------------------------------------------
def run_llmlab(model, workload: dict, arrivals: list[float], *, num_gpu_blocks: int | None = None,
               block_size: int = 16, max_num_seqs: int = 256, device: str = "cpu",
               quantization: str | None = None, **engine_args) -> dict:
    """Serve ``workload`` with :class:`~llmlab.inference.LLMEngine`; returns the CONTRACT entry
    (throughput, TTFT/TPOT p50/p99, ``kv_cache_waste_fraction`` averaged over steps,
    ``num_preemptions``) plus ``token_ids`` (the generated tokens per request)."""
    from llmlab.inference import LLMEngine, SamplingParams
    eng = LLMEngine(model, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                    max_num_seqs=max_num_seqs, device=device, quantization=quantization, **engine_args)
    prompts, olens = workload["prompts"], workload["output_lens"]
    n = len(prompts)
    order = sorted(range(n), key=lambda i: arrivals[i])
    t0 = time.perf_counter()
    k = 0
    while k < n or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while k < n and arrivals[order[k]] <= now:
            i = order[k]
            eng.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=olens[i],
                                                       ignore_eos=True),
                            request_id=str(i), arrival_time=t0 + arrivals[i])
            k += 1
        if eng.has_unfinished_requests():
            eng.step()
        elif k < n:
            time.sleep(max(0.0, arrivals[order[k]] - (time.perf_counter() - t0)))
    outs = [eng.get_output(str(i)) for i in range(n)]
    timings = [RequestTiming(o.metrics.arrival_time, o.metrics.first_token_time,
                             o.metrics.finish_time, o.metrics.num_output_tokens) for o in outs]
    steps = eng.step_metrics
    res = summarize(timings)
    res["kv_cache_waste_fraction"] = sum(s.kv_waste_fraction for s in steps) / len(steps)
    res["num_preemptions"] = sum(s.num_preemptions for s in steps)
    res["num_gpu_blocks"] = eng.num_gpu_blocks
    res["kv_cache_bytes"] = eng.runner.kv_cache_bytes
    res["num_steps"] = len(steps)
    res["token_ids"] = [o.outputs[0].token_ids for o in outs]
    return res


# --- Hugging Face --------------------------------------------------------------------------------
class _TimingStreamer:
    """``generate`` streamer: the time of every ``put`` after the prompt (one per new token)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def load_hf(path, device: str = "cpu"):
    """``transformers.AutoModelForCausalLM`` for the checkpoint ``path`` (fp32, eval)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()


@torch.no_grad()
def hf_generate_batch(hf_model, prompts: list[list[int]], num_new: int, pad_token_id: int = 0,
                      streamer=None) -> list[list[int]]:
    """Static batch: left-padded ``prompts``, exactly ``num_new`` greedy tokens for every row."""
    dev = next(hf_model.parameters()).device
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, L - len(p):] = torch.tensor(p)
        mask[r, L - len(p):] = 1
    out = hf_model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=False,
                            max_new_tokens=num_new, min_new_tokens=num_new,
                            pad_token_id=pad_token_id, eos_token_id=None, streamer=streamer)
    return out[:, L:].tolist()


def run_hf(hf_model, workload: dict, arrivals: list[float], batch_size: int) -> dict:
    """Serve ``workload`` with static batches of ``batch_size`` (arrival order); same entry as
    :func:`run_llmlab` without preemptions."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    prompts, olens = workload["prompts"], workload["output_lens"]
    n = len(prompts)
    order = sorted(range(n), key=lambda i: arrivals[i])
    timings: list[RequestTiming | None] = [None] * n
    tokens: list[list[int] | None] = [None] * n
    waste_sum, waste_steps = 0.0, 0
    t0 = time.perf_counter()
    for b in range(0, n, batch_size):
        idx = order[b:b + batch_size]
        wait = arrivals[idx[-1]] - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        O = max(olens[i] for i in idx)
        P = max(len(prompts[i]) for i in idx)
        st = _TimingStreamer()
        out = hf_generate_batch(hf_model, [prompts[i] for i in idx], O, streamer=st)
        if len(st.times) != O:
            raise RuntimeError(f"streamer saw {len(st.times)} tokens, expected {O}")
        for r, i in enumerate(idx):
            o = olens[i]
            tokens[i] = out[r][:o]
            timings[i] = RequestTiming(t0 + arrivals[i], st.times[0], st.times[o - 1], o)
        alloc = len(idx) * (P + O)
        for t in range(1, O + 1):           # cache after decode step t
            stored = sum(len(prompts[i]) + min(t, olens[i]) for i in idx)
            waste_sum += 1.0 - stored / alloc
            waste_steps += 1
    res = summarize(timings)
    res["kv_cache_waste_fraction"] = waste_sum / waste_steps
    res["batch_size"] = batch_size
    res["token_ids"] = tokens
    return res


def check_equal_outputs(model, hf_model, workload: dict, num: int = 4, device: str = "cpu") -> None:
    """Correctness gate: greedy tokens of the engine and of HF (one left-padded static batch) on
    the first ``num`` requests. Raises ``RuntimeError`` naming the first request that differs."""
    num = min(num, len(workload["prompts"]))
    sub = {k: v[:num] for k, v in workload.items()}
    got = run_llmlab(model, sub, [0.0] * num, device=device)["token_ids"]
    want = run_hf(hf_model, sub, [0.0] * num, batch_size=num)["token_ids"]
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            j = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
            raise RuntimeError(f"request {i}: llmlab and HF greedy tokens differ at output "
                               f"position {j} ({a[j]} vs {b[j]})")


# --- the command ---------------------------------------------------------------------------------
def _public(entry: dict, hf: bool = False) -> dict:
    drop = {"token_ids"} | ({"num_preemptions"} if hf else set())
    return {k: v for k, v in entry.items() if k not in drop}


def bench_serve(model="shakespeare", num_requests: int = 64, request_rate: float | None = None,
                baseline: str | None = None, memory_matched_batch: int | None = None,
                seed: int = 0, block_size: int = 16, max_num_seqs: int = 256,
                prompt_len_median: float = 32.0, output_len_median: float = 32.0,
                hf_batch_sizes=HF_BATCH_SIZES, device: str = "cpu", check: bool = True,
                quantization: str | None = None) -> dict:
    """Run the benchmark and return the CONTRACT dict (see module docstring)."""
    from llmlab.inference import loader
    from llmlab.inference.engine import _pick_device
    if memory_matched_batch is not None and memory_matched_batch < 1:
        raise ValueError(f"--memory-matched-batch={memory_matched_batch} must be >= 1")
    if baseline not in (None, "hf"):
        raise ValueError(f"--baseline {baseline!r}: only 'hf' is supported")
    device = str(_pick_device(device))
    path = loader.resolve_model_path(str(model))
    cfg = json.loads((path / "config.json").read_text())
    ctx = int(cfg.get("max_position_embeddings", 512))
    wl = sharegpt_workload(num_requests, seed=seed, max_len=ctx, vocab_size=int(cfg["vocab_size"]),
                           prompt_len_median=prompt_len_median, output_len_median=output_len_median)
    arrivals = poisson_arrivals(num_requests, request_rate, seed)
    max_len = max(p + o for p, o in zip(wl["prompt_lens"], wl["output_lens"]))
    blocks = (None if memory_matched_batch is None
              else math.ceil(memory_matched_batch * max_len / block_size))
    torch.manual_seed(seed)
    hf_model = load_hf(path, device) if baseline == "hf" else None
    if hf_model is not None and check:
        check_equal_outputs(str(path), hf_model, wl, device=device)     # also warms both up
    else:
        run_llmlab(str(path), {k: v[:1] for k, v in wl.items()}, [0.0], device=device)  # warm-up
    ours = run_llmlab(str(path), wl, arrivals, num_gpu_blocks=blocks, block_size=block_size,
                      max_num_seqs=max_num_seqs, device=device, quantization=quantization)
    result = {"workload": {"num_requests": num_requests, "prompt_lens": wl["prompt_lens"],
                           "output_lens": wl["output_lens"]},
              "config": {"model": str(model), "request_rate": request_rate, "seed": seed,
                         "memory_matched_batch": memory_matched_batch, "block_size": block_size,
                         "max_len": max_len, "device": device, "quantization": quantization},
              "llmlab": _public(ours)}
    if hf_model is not None:
        sizes = ([memory_matched_batch] if memory_matched_batch is not None
                 else sorted({min(b, num_requests) for b in hf_batch_sizes}))
        runs = [run_hf(hf_model, wl, arrivals, b) for b in sizes]
        best = max(runs, key=lambda r: r["throughput_tokens_per_s"])
        entry = _public(best, hf=True)
        entry["sweep"] = [{"batch_size": r["batch_size"],
                           "throughput_tokens_per_s": r["throughput_tokens_per_s"],
                           "kv_cache_waste_fraction": r["kv_cache_waste_fraction"]} for r in runs]
        result["hf"] = entry
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="shakespeare", help="checkpoint directory or shipped preset")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals, requests/s (default: all at t=0, offline)")
    p.add_argument("--baseline", choices=["hf"], default=None)
    p.add_argument("--memory-matched-batch", type=int, default=None, metavar="B")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--prompt-len-median", type=float, default=32.0)
    p.add_argument("--output-len-median", type=float, default=32.0)
    p.add_argument("--quantization", choices=["int8"], default=None)
    p.add_argument("--device", default="cpu", help="auto|cpu|cuda")
    p.add_argument("--json", required=True, metavar="OUT")


def run(args) -> int:
    res = bench_serve(args.model, args.num_requests, args.request_rate, args.baseline,
                      args.memory_matched_batch, seed=args.seed, block_size=args.block_size,
                      max_num_seqs=args.max_num_seqs, prompt_len_median=args.prompt_len_median,
                      output_len_median=args.output_len_median, device=args.device,
                      quantization=args.quantization)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    for name in ("llmlab", "hf"):
        if name in res:
            r = res[name]
            print(f"{name:7s} {r['throughput_tokens_per_s']:9.1f} tok/s  TTFT p50 "
                  f"{r['ttft_s']['p50']:.3f}s p99 {r['ttft_s']['p99']:.3f}s  TPOT p50 "
                  f"{r['tpot_s']['p50'] * 1e3:.1f}ms  KV waste {r['kv_cache_waste_fraction']:.1%}")
    return 0
