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
- HF continuous (``hf_continuous``, where the installed transformers has it, >= 5): transformers'
  own continuous batching, the engine behind ``model.generate_batch`` (``ContinuousBatchingManager``
  over a paged cache), given the same blocks as llmlab; its greedy tokens are compared with ours on
  a few requests before timing and on every request after, and the counts are reported.
- ``--memory-matched-batch B``: both get the KV bytes of B sequences at the workload's maximum
  length: HF runs batches of B; llmlab gets ``num_gpu_blocks = ceil(B * max_len / block_size)``.
  Without it HF sweeps batch sizes (8, 16, 32, 64) and its best throughput is reported.

The workload and the waste arithmetic are :mod:`llmlab.inference.workload`, the HF harnesses
:mod:`llmlab.inference.hf_baseline`; this module runs the engine, compares and reports.

JSON written to ``--json``: see CONTRACT ``llmlab bench`` (plus extra keys ``e2e_s``,
``duration_s``, ``num_output_tokens``, ``config``; for HF ``batch_size``, ``sweep`` and
``outputs_vs_llmlab``; ``hf_continuous`` (or ``hf_continuous_skipped`` with the reason)).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from llmlab.inference.engine_config import add_engine_arguments
from llmlab.inference.hf_baseline import (
    hf_continuous_available,
    load_hf,
    run_hf,  # noqa: F401
    run_hf_continuous,
)
from llmlab.inference.loader import ModelSpec
from llmlab.inference.metrics import summarize
from llmlab.inference.workload import (
    WASTE_BLOCK_SIZES,
    poisson_arrivals,  # noqa: F401
    sharegpt_workload,
    trace_waste,
)

HF_BATCH_SIZES = (8, 16, 32, 64)
ENGINE_FLAGS = ["block_size", "max_num_seqs", "quantization", "device"]  # EngineConfig fields


# --- llmlab --------------------------------------------------------------------------------------
def run_llmlab(
    model: ModelSpec,
    workload: dict[str, Any],
    arrivals: list[float],
    *,
    num_gpu_blocks: int | None = None,
    block_size: int = 16,
    max_num_seqs: int = 256,
    device: str = "cpu",
    quantization: str | None = None,
    **engine_args: Any,
) -> dict[str, Any]:
    """Serve ``workload`` with :class:`~llmlab.inference.LLMEngine`; returns the CONTRACT entry
    (throughput, TTFT/TPOT p50/p99, ``kv_cache_waste_fraction`` averaged over steps,
    ``num_preemptions``) plus ``token_ids`` (the generated tokens per request)."""
    from llmlab.inference import LLMEngine, SamplingParams

    eng = LLMEngine(
        model,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=max_num_seqs,
        device=device,
        quantization=quantization,
        **engine_args,
    )
    prompts, olens = workload["prompts"], workload["output_lens"]
    n = len(prompts)
    order = sorted(range(n), key=lambda i: arrivals[i])
    t0 = time.perf_counter()
    k = 0
    while k < n or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while k < n and arrivals[order[k]] <= now:
            i = order[k]
            eng.add_request(
                prompts[i],
                SamplingParams(temperature=0.0, max_tokens=olens[i], ignore_eos=True),
                request_id=str(i),
                arrival_time=t0 + arrivals[i],
            )
            k += 1
        if eng.has_unfinished_requests():
            eng.step()
        elif k < n:
            time.sleep(max(0.0, arrivals[order[k]] - (time.perf_counter() - t0)))
    outs = [eng.get_output(str(i)) for i in range(n)]
    timings = [o.metrics.timing() for o in outs]
    steps = eng.step_metrics
    res = summarize(timings)
    held = [s for s in steps if s.kv_blocks_used]  # a step holding no block has no waste share
    res["kv_cache_waste_fraction"] = sum(s.kv_waste_fraction for s in held) / len(held) if held else 0.0
    res["num_preemptions"] = sum(s.num_preemptions for s in steps)
    res["num_gpu_blocks"] = eng.num_gpu_blocks
    res["kv_cache_bytes"] = eng.runner.kv_cache_bytes
    res["num_steps"] = len(steps)
    res["kv_waste_by_block_size"] = {
        str(b): trace_waste([s.seq_lens for s in steps], b) for b in WASTE_BLOCK_SIZES
    }  # same steps, other blocks
    res["token_ids"] = [o.outputs[0].token_ids for o in outs]
    return res


def warmup_llmlab(
    path: str,
    wl: dict[str, Any],
    num_gpu_blocks: int | None,
    block_size: int,
    max_num_seqs: int,
    device: str,
    quantization: str | None,
    k: int = 4,
) -> dict[str, Any]:
    """Run the first ``k`` requests with the *timed* run's engine settings (block size, cache
    blocks, quantization), so that the Triton kernels are compiled for the specialisations the
    timed steps use; on CUDA also compile every PagedAttention ``BLOCK_M`` variant
    (:func:`~llmlab.kernels.paged_attention.compile_variants`). Returns the warm-up run."""
    sub = {key: v[:k] for key, v in wl.items()}
    res = run_llmlab(
        path,
        sub,
        [0.0] * len(sub["prompts"]),
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        device=device,
        quantization=quantization,
    )
    if str(device).startswith("cuda"):
        from llmlab.inference import loader
        from llmlab.inference.paged_attention import _triton_installed

        if _triton_installed():
            from llmlab.kernels.paged_attention import compile_variants

            mc = loader.load(path)[0].config  # the engine runs fp32 here (run_llmlab)
            compile_variants(
                mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, block_size, torch.float32, device
            )
    return res


# --- comparisons ---------------------------------------------------------------------------------
def compare_outputs(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """How many requests and output tokens of ``theirs`` equal ``ours`` position by position:
    ``{"requests_equal", "num_requests", "tokens_equal", "num_tokens", "first_difference"}``
    (``first_difference``: ``[request, position]`` of the first mismatch, or None)."""
    req_eq = tok_eq = tot = 0
    first: list[int] | None = None
    for i, (a, b) in enumerate(zip(ours, theirs)):
        same = [x == y for x, y in zip(a, b)]
        tok_eq += sum(same)
        tot += max(len(a), len(b))
        if a == b:
            req_eq += 1
        elif first is None:
            first = [i, same.index(False) if False in same else min(len(a), len(b))]
    return {
        "requests_equal": req_eq,
        "num_requests": len(ours),
        "tokens_equal": tok_eq,
        "num_tokens": tot,
        "first_difference": first,
    }


def check_equal_outputs(
    model: ModelSpec, hf_model: Any, workload: dict[str, Any], num: int = 4, device: str = "cpu"
) -> None:
    """Correctness gate: greedy tokens of the engine and of HF (one left-padded static batch) on
    the first ``num`` requests. Raises ``RuntimeError`` naming the first request that differs."""
    num = min(num, len(workload["prompts"]))
    sub = {k: v[:num] for k, v in workload.items()}
    got = run_llmlab(model, sub, [0.0] * num, device=device)["token_ids"]
    want = run_hf(hf_model, sub, [0.0] * num, batch_size=num)["token_ids"]
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            j = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
            raise RuntimeError(
                f"request {i}: llmlab and HF greedy tokens differ at output position {j} ({a[j]} vs {b[j]})"
            )


# --- the command ---------------------------------------------------------------------------------
def _public(entry: dict[str, Any], hf: bool = False) -> dict[str, Any]:
    drop = {"token_ids"} | ({"num_preemptions"} if hf else set())
    return {k: v for k, v in entry.items() if k not in drop}


def bench_serve(
    model: str | Path = "shakespeare",
    num_requests: int = 64,
    request_rate: float | None = None,
    baseline: str | None = None,
    memory_matched_batch: int | None = None,
    seed: int = 0,
    block_size: int = 16,
    max_num_seqs: int = 256,
    prompt_len_median: float = 32.0,
    output_len_median: float = 32.0,
    hf_batch_sizes: Iterable[int] = HF_BATCH_SIZES,
    device: str = "cpu",
    check: bool = True,
    quantization: str | None = None,
    hf_continuous: bool = True,
    length_sigma: float = 0.9,
    num_threads: int | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Run the benchmark and return the CONTRACT dict (see module docstring). With
    ``baseline="hf"`` and ``hf_continuous`` the result also has ``"hf_continuous"`` (transformers'
    own continuous batching, :func:`run_hf_continuous`) or ``"hf_continuous_skipped"`` (why not).
    ``length_sigma`` is the lognormal shape of both length distributions (:func:`sharegpt_workload`).
    ``repeats``: rounds in which the systems take turns on the same workload; each system reports
    its median-throughput round (a shared machine's load changes within seconds).
    ``num_threads``: ``torch.set_num_threads`` for every system of the run (None: leave as is).
    On CPU, 1 is the fair and fast choice for a tiny model: its matrices are too small to gain
    from intra-op threads, and on a loaded machine a 2-thread OpenMP team spin-waits for a busy
    core (measured here: one 16x128 @ 128x384 linear 2.5 ms with 2 threads, 0.23 ms with 1) -- while
    transformers' continuous batching runs its loop in a background thread, where the same op
    behaves differently; one setting for all makes the comparison about batching."""
    from llmlab.inference import loader
    from llmlab.runtime.hardware import resolve_device

    _check_bench_args(memory_matched_batch, repeats, baseline, num_threads)
    device = resolve_device(str(device))
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    path = loader.resolve_model_path(str(model))
    cfg = json.loads((path / "config.json").read_text())
    ctx = int(cfg.get("max_position_embeddings", 512))
    wl = sharegpt_workload(
        num_requests,
        seed=seed,
        max_len=ctx,
        vocab_size=int(cfg["vocab_size"]),
        prompt_len_median=prompt_len_median,
        output_len_median=output_len_median,
        sigma=length_sigma,
    )
    arrivals = poisson_arrivals(num_requests, request_rate, seed)
    max_len = max(p + o for p, o in zip(wl["prompt_lens"], wl["output_lens"]))
    blocks = None if memory_matched_batch is None else math.ceil(memory_matched_batch * max_len / block_size)
    args = (str(path), wl, arrivals, ctx, max_len, device, block_size, max_num_seqs, quantization)
    run = _BenchRun(*args, blocks=blocks)
    torch.manual_seed(seed)
    hf_model = load_hf(path, device) if baseline == "hf" else None
    cb_skip = None
    if hf_model is not None:
        cb_skip = "hf_continuous=False" if not hf_continuous else hf_continuous_available(hf_model)
    run.gates(hf_model, check, cb_skip is None)
    sizes = _hf_batch_sizes(hf_model is not None, memory_matched_batch, num_requests, hf_batch_sizes)
    r_ours, r_hf, r_cb = run.rounds(hf_model, sizes, repeats, cb_skip is None)
    config = dict(model=str(model), request_rate=request_rate, seed=seed)
    config |= dict(memory_matched_batch=memory_matched_batch, block_size=block_size, max_len=max_len)
    config |= dict(device=device, quantization=quantization, length_sigma=length_sigma)
    config |= dict(num_threads=torch.get_num_threads(), repeats=repeats)
    workload = dict(num_requests=num_requests, prompt_lens=wl["prompt_lens"], output_lens=wl["output_lens"])
    result = {"workload": workload, "config": config}
    result.update(_report(r_ours, r_hf, r_cb, sizes, hf_model is not None, cb_skip, run.cb_check))
    return result


def _check_bench_args(
    memory_matched_batch: int | None, repeats: int, baseline: str | None, num_threads: int | None
) -> None:
    """``ValueError`` naming the flag of :func:`bench_serve` that is out of range."""
    if memory_matched_batch is not None and memory_matched_batch < 1:
        raise ValueError(f"--memory-matched-batch={memory_matched_batch} must be >= 1")
    if repeats < 1:
        raise ValueError(f"--repeats={repeats} must be >= 1")
    if baseline not in (None, "hf"):
        raise ValueError(f"--baseline {baseline!r}: only 'hf' is supported")
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads={num_threads} must be >= 1")


def _hf_batch_sizes(
    has_hf: bool, memory_matched_batch: int | None, num_requests: int, hf_batch_sizes: Iterable[int]
) -> list[int]:
    """The static batch sizes HF runs at: none without a baseline, the memory-matched one, or
    ``hf_batch_sizes`` capped at the number of requests."""
    if not has_hf:
        return []
    if memory_matched_batch is not None:
        return [memory_matched_batch]
    return sorted({min(b, num_requests) for b in hf_batch_sizes})


class _BenchRun:
    """One benchmark's fixed inputs, and its phases: the correctness gates (and warm-ups), then
    the timed rounds in which the systems take turns."""

    def __init__(
        self,
        path: str,
        wl: dict[str, Any],
        arrivals: list[float],
        ctx: int,
        max_len: int,
        device: str,
        block_size: int,
        max_num_seqs: int,
        quantization: str | None,
        blocks: int | None,
    ) -> None:
        self.path, self.wl, self.arrivals, self.ctx, self.max_len = path, wl, arrivals, ctx, max_len
        self.device, self.block_size, self.max_num_seqs = device, block_size, max_num_seqs
        self.quantization, self.blocks = quantization, blocks
        self.cb_check: dict[str, Any] | None = None

    def gates(self, hf_model: Any, check: bool, with_cb: bool) -> None:
        """Greedy tokens vs HF before timing (raised), then the engine's warm-up; for HF's
        continuous batching the comparison on the first requests is reported, not raised (its
        kernels may round differently)."""
        if hf_model is not None and check:
            check_equal_outputs(self.path, hf_model, self.wl, device=self.device)  # also warms up
        warmup_llmlab(
            self.path,
            self.wl,
            self.blocks,
            self.block_size,
            self.max_num_seqs,
            self.device,
            self.quantization,
        )
        if hf_model is not None and with_cb:
            k = min(4, len(self.wl["prompts"]))
            sub = {key: v[:k] for key, v in self.wl.items()}
            mine = run_llmlab(self.path, sub, [0.0] * k, device=self.device)["token_ids"]
            theirs = run_hf_continuous(
                hf_model,
                sub,
                [0.0] * k,
                num_blocks=self.blocks or k * math.ceil(self.max_len / self.block_size),
                block_size=self.block_size,
            )["token_ids"]
            self.cb_check = compare_outputs(mine, theirs)

    def rounds(
        self, hf_model: Any, sizes: list[int], repeats: int, with_cb: bool
    ) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]], list[dict[str, Any]]]:
        """``repeats`` rounds: llmlab, HF at each batch size, HF continuous; every run kept."""
        r_ours: list[dict[str, Any]] = []
        r_hf: dict[int, list[dict[str, Any]]] = {b: [] for b in sizes}
        r_cb: list[dict[str, Any]] = []
        for _ in range(repeats):
            r_ours.append(
                run_llmlab(
                    self.path,
                    self.wl,
                    self.arrivals,
                    num_gpu_blocks=self.blocks,
                    block_size=self.block_size,
                    max_num_seqs=self.max_num_seqs,
                    device=self.device,
                    quantization=self.quantization,
                )
            )
            for b in sizes:
                r_hf[b].append(run_hf(hf_model, self.wl, self.arrivals, b))
            if hf_model is not None and with_cb:
                r_cb.append(
                    run_hf_continuous(
                        hf_model,
                        self.wl,
                        self.arrivals,
                        num_blocks=r_ours[-1]["num_gpu_blocks"],
                        block_size=self.block_size,
                        max_num_seqs=self.max_num_seqs,
                        max_batch_tokens=max(2048, self.ctx),
                    )
                )
        return r_ours, r_hf, r_cb


def _report(
    r_ours: list[dict[str, Any]],
    r_hf: dict[int, list[dict[str, Any]]],
    r_cb: list[dict[str, Any]],
    sizes: list[int],
    has_hf: bool,
    cb_skip: str | None,
    cb_check: dict[str, Any] | None,
) -> dict[str, Any]:
    """Each system's median round as the CONTRACT entries (HF: its best batch size)."""
    ours = _median_run(r_ours)
    result: dict[str, Any] = {"llmlab": _public(ours)}
    if not has_hf:
        return result
    runs = [_median_run(r_hf[b]) for b in sizes]
    best = max(runs, key=lambda r: r["throughput_tokens_per_s"])
    entry = _public(best, hf=True)
    entry["sweep"] = [
        {
            "batch_size": r["batch_size"],
            "throughput_tokens_per_s": r["throughput_tokens_per_s"],
            "kv_cache_waste_fraction": r["kv_cache_waste_fraction"],
        }
        for r in runs
    ]
    entry["outputs_vs_llmlab"] = compare_outputs(ours["token_ids"], best["token_ids"])
    result["hf"] = entry
    if cb_skip is None:
        cb = _median_run(r_cb)
        cb_entry = _public(cb)
        cb_entry["gate_vs_llmlab"] = cb_check
        cb_entry["outputs_vs_llmlab"] = compare_outputs(ours["token_ids"], cb["token_ids"])
        result["hf_continuous"] = cb_entry
    else:
        result["hf_continuous_skipped"] = cb_skip
    return result


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median throughput (the upper one of an even count), with every
    round's throughput listed in ``throughput_runs``."""
    ranked = sorted(runs, key=lambda r: r["throughput_tokens_per_s"])
    out = dict(ranked[len(ranked) // 2])
    out["throughput_runs"] = [r["throughput_tokens_per_s"] for r in runs]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="shakespeare", help="checkpoint directory or shipped preset")
    p.add_argument("--num-requests", type=int, default=64, help="requests in the seeded workload")
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals, requests/s (default: all at t=0, offline)",
    )
    p.add_argument(
        "--baseline",
        choices=["hf"],
        default=None,
        help="also run Hugging Face static-batch generate on the same weights",
    )
    p.add_argument(
        "--memory-matched-batch",
        type=int,
        default=None,
        metavar="B",
        help="give the engine the KV blocks of B full-length sequences and run HF at "
        "batch B (default: the engine sizes its cache, HF runs several batch sizes)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")
    p.add_argument("--prompt-len-median", type=float, default=32.0, help="median prompt tokens")
    p.add_argument("--output-len-median", type=float, default=32.0, help="median output tokens")
    p.add_argument(
        "--length-sigma",
        type=float,
        default=0.9,
        help="lognormal shape of prompt and output lengths (0: all at the median)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch.set_num_threads for every system (default 1; 0: leave torch's default)",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="rounds, systems taking turns; each reports its median round"
    )
    p.add_argument(
        "--no-hf-continuous",
        action="store_true",
        help="with --baseline hf, skip transformers' continuous batching",
    )
    add_engine_arguments(
        p,
        ENGINE_FLAGS,
        {
            "device": {
                "default": "cpu",
                "choices": None,
                "help": "where every system runs: auto, cpu or cuda[:N]",
            }
        },
    )
    p.add_argument("--json", default=None, metavar="OUT", help="write every system's results here")


def run(args: argparse.Namespace) -> int:
    res = bench_serve(
        args.model,
        args.num_requests,
        args.request_rate,
        args.baseline,
        args.memory_matched_batch,
        seed=args.seed,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        prompt_len_median=args.prompt_len_median,
        output_len_median=args.output_len_median,
        device=args.device,
        quantization=args.quantization,
        hf_continuous=not args.no_hf_continuous,
        length_sigma=args.length_sigma,
        num_threads=args.num_threads or None,
        repeats=args.repeats,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if getattr(args, "tensorboard", None):  # llmlab bench serve --tensorboard DIR
        from llmlab.metrics.tensorboard import write_bench

        write_bench(res, args.tensorboard)
    what = {
        "llmlab": "continuous batching, paged KV cache",
        "hf": (f"HF generate, static batches of {res['hf'].get('batch_size')}" if "hf" in res else ""),
        "hf_continuous": "transformers' continuous batching (generate_batch), same KV blocks",
    }
    for name in ("llmlab", "hf", "hf_continuous"):
        if name in res:
            r = res[name]
            w = r["kv_cache_waste_fraction"]
            extra = ""
            if "outputs_vs_llmlab" in r:
                c = r["outputs_vs_llmlab"]
                extra = f"  greedy tokens equal to llmlab: {c['requests_equal']}/{c['num_requests']} requests"
            print(
                f"{name:13s} {r['throughput_tokens_per_s']:9.1f} tok/s  TTFT p50 "
                f"{r['ttft_s']['p50']:.3f}s p99 {r['ttft_s']['p99']:.3f}s  TPOT p50 "
                f"{r['tpot_s']['p50'] * 1e3:.1f}ms  KV waste "
                f"{'n/a' if w is None else format(w, '.1%')}{extra}   ({what[name]})"
            )
    for name in ("hf", "hf_continuous"):
        if name in res and res[name]["throughput_tokens_per_s"]:
            print(
                f"throughput llmlab / {name} = "
                f"{res['llmlab']['throughput_tokens_per_s'] / res[name]['throughput_tokens_per_s']:.2f}x"
            )
    if "hf_continuous_skipped" in res:
        print(f"hf_continuous skipped: {res['hf_continuous_skipped']}")
    return 0
