"""The serving tuning knobs, measured: each knob swept on the same seeded workload, side by side.

The seed's deployment notes (vLLM in production) tune five things; in llmlab they are:

=====================  =====================================  ==================================
knob (seed)            llmlab parameter                       what :func:`sweep` measures
=====================  =====================================  ==================================
max_token              ``SamplingParams.max_tokens``          tokens, throughput, TTFT, e2e
temperature / top_k    ``SamplingParams.temperature, top_k``  sampling ms/step, distinct tokens,
                                                              repeated 4-grams, throughput
max-model-len          ``LLMEngine(max_model_len=)``          KV blocks reserved, rejected and
                                                              truncated requests
max concurrency        ``LLMEngine(max_num_seqs=)``           throughput, TTFT/TPOT, preemptions
enable-chunked-prefill ``enable_chunked_prefill`` +           largest / longest step, TPOT p99
                       ``max_num_batched_tokens``             (decode stalls), TTFT
=====================  =====================================  ==================================

Every run serves its workload offline (all requests queued at t=0) through
:class:`~llmlab.inference.LLMEngine`; a request's "natural" output length from
:func:`~llmlab.inference.workload.sharegpt_workload` stands for where the model would stop
(``ignore_eos``), and ``max_tokens`` caps it. Metrics follow :mod:`llmlab.inference.metrics`.
``benchmarks/bench_serve_knobs.py`` runs every sweep and prints the table; docs/serving-tuning.md
records the numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from llmlab.inference.workload import sharegpt_workload
from llmlab.inference.metrics import summarize

if TYPE_CHECKING:
    from llmlab.inference.loader import ModelSpec
    from llmlab.inference.outputs import StepMetrics

# The values each knob is swept over (first = the baseline the others are compared with).
SWEEPS: dict[str, list[Any]] = {
    "max_tokens": [None, 64, 16, 1],
    "sampling": [
        {"temperature": 0.0},
        {"temperature": 0.7, "top_k": 1},
        {"temperature": 0.7},
        {"temperature": 1.0},
        {"temperature": 1.0, "top_k": 20},
    ],
    "max_model_len": [512, 128, 64],
    "max_num_seqs": [1, 4, 16, 64],
    "chunked_prefill": [None, 256, 64, 32],
}


def knob_workload(knob: str, num_requests: int = 16, seed: int = 0) -> dict[str, list[Any]]:
    """The workload a knob is measured on (ShareGPT-like, byte tokens of the bundled corpus).

    ``chunked_prefill``: short chat requests plus one long prompt (~400 tokens, 4 output
    tokens) in every four, so long prefills arrive while others decode; others: a mixed workload
    with long outputs (median 48) so that ``max_tokens`` and ``max_model_len`` bite."""
    if knob == "chunked_prefill":
        wl = sharegpt_workload(
            num_requests, seed=seed, max_len=512, prompt_len_median=8, output_len_median=24, sigma=0.5
        )
        long = sharegpt_workload(
            num_requests, seed=seed + 1, max_len=512, prompt_len_median=400, output_len_median=4, sigma=0.1
        )
        for i in range(2, num_requests, 4):
            wl["prompts"][i] = long["prompts"][i][:250] + long["prompts"][i - 1][:150]
            wl["prompt_lens"][i], wl["output_lens"][i] = len(wl["prompts"][i]), 4
        return wl
    return sharegpt_workload(num_requests, seed=seed, max_len=512, prompt_len_median=24, output_len_median=48)


def _repeated_4gram_fraction(ids: list[int]) -> float:
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return 0.0 if not grams else 1.0 - len(set(grams)) / len(grams)


def serve(
    workload: dict[str, Any],
    *,
    model: ModelSpec = "shakespeare",
    device: str = "cpu",
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    on_step: Callable[[StepMetrics], object] | None = None,
    **engine_args: Any,
) -> dict[str, Any]:
    """Serve ``workload`` once; returns throughput (output tokens/s), ``ttft_s``/``tpot_s``/
    ``e2e_s`` p50/p99 (seconds), KV usage (peak and mean fraction of blocks), preemptions, step
    sizes and times, sampling seconds per step, the generated ``token_ids`` per served request
    and counts of ``rejected`` (``ValueError`` at ``add_request``) and ``truncated`` requests
    (stopped by ``max_model_len`` before their length). ``engine_args`` go to ``LLMEngine``."""
    from llmlab.inference import LLMEngine, SamplingParams

    eng = LLMEngine(model, device=device, on_step=on_step, **engine_args)
    ids: list[str] = []
    rejected = 0
    want: dict[str, int] = {}
    for i, (p, n) in enumerate(zip(workload["prompts"], workload["output_lens"])):
        n = n if max_tokens is None else min(n, max_tokens)
        try:
            eng.add_request(
                p,
                SamplingParams(
                    temperature=temperature, top_k=top_k, seed=seed + i, max_tokens=n, ignore_eos=True
                ),
                request_id=str(i),
            )
        except ValueError:
            rejected += 1
            continue
        ids.append(str(i))
        want[str(i)] = n
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    wall = time.perf_counter() - t0
    outs = [eng.get_output(r) for r in ids]
    sm = eng.step_metrics
    res = summarize([o.metrics.timing() for o in outs])
    tokens = [o.outputs[0].token_ids for o in outs]
    res.update(
        {
            "wall_s": wall,
            "num_requests": len(ids),
            "rejected": rejected,
            "truncated": sum(len(t) < want[o.request_id] for o, t in zip(outs, tokens)),
            "num_steps": len(sm),
            "num_preemptions": sum(s.num_preemptions for s in sm),
            "kv_usage_peak": max(s.kv_blocks_used / s.kv_blocks_total for s in sm),
            "kv_usage_mean": sum(s.kv_blocks_used / s.kv_blocks_total for s in sm) / len(sm),
            "num_gpu_blocks": eng.num_gpu_blocks,
            "kv_cache_bytes": eng.runner.kv_cache_bytes,
            "max_step_tokens": max(s.num_batched_tokens for s in sm),
            "max_step_s": max(s.duration_s for s in sm),
            "mean_step_s": sum(s.duration_s for s in sm) / len(sm),
            "sampling_s_per_step": sum(s.sample_s for s in sm) / len(sm),
            "distinct_1": len({t for ts in tokens for t in ts}) / max(1, sum(map(len, tokens))),
            "distinct_2": (
                len({(a, b) for ts in tokens for a, b in zip(ts, ts[1:])})
                / max(1, sum(max(0, len(ts) - 1) for ts in tokens))
            ),
            "repeated_4gram": sum(map(_repeated_4gram_fraction, tokens)) / max(1, len(tokens)),
            "token_ids": tokens,
        }
    )
    return res


def _setting(knob: str, value: Any) -> tuple[str, dict[str, Any]]:
    """(label, keyword arguments of :func:`serve`) for one value of ``knob``."""
    if knob == "max_tokens":
        return (f"max_tokens={value}" if value else "max_tokens=natural"), {"max_tokens": value}
    if knob == "sampling":
        lab = "greedy" if value.get("temperature", 1.0) == 0 else f"T={value['temperature']}"
        if value.get("top_k"):
            lab += f" top_k={value['top_k']}"
        return lab, dict(value)
    if knob == "max_model_len":
        return f"max_model_len={value}", {"max_model_len": value}
    if knob == "max_num_seqs":
        return f"max_num_seqs={value}", {"max_num_seqs": value}
    if knob == "chunked_prefill":
        if value is None:
            return "chunked off", {"enable_chunked_prefill": False}
        return f"chunked, budget {value}", {"enable_chunked_prefill": True, "max_num_batched_tokens": value}
    raise ValueError(f"unknown knob {knob!r}; knobs: {', '.join(SWEEPS)}")


# Engine settings shared by every run of a knob's sweep (the knob's own value overrides them).
BASE: dict[str, dict[str, Any]] = {
    "max_tokens": {"max_num_seqs": 8},
    "sampling": {"max_num_seqs": 8},
    "max_model_len": {"max_num_seqs": 8},
    "max_num_seqs": {"num_gpu_blocks": 48},  # a fixed pool of 48 x 16 = 768 tokens
    "chunked_prefill": {"max_num_seqs": 8},
}


def sweep(
    knob: str,
    values: Iterable[Any] | None = None,
    *,
    num_requests: int = 16,
    seed: int = 0,
    model: ModelSpec = "shakespeare",
    device: str = "cpu",
    repeats: int = 1,
    warmup: bool = True,
    on_run: Callable[[dict[str, Any]], object] | None = None,
) -> list[dict[str, Any]]:
    """Serve :func:`knob_workload` once per value of ``knob`` (default ``SWEEPS[knob]``); one row
    per value: ``{"knob", "value", "label", **serve(...)}`` (``token_ids`` dropped, and for
    ``sampling`` ``same_as_first``: the share of requests whose tokens equal the first setting's).

    Timings on a shared machine are noisy: ``warmup`` serves two requests first (the first run
    otherwise pays one-off costs), and ``repeats > 1`` runs the settings round-robin that many
    times and keeps, per setting, the run with the highest throughput (``runs_tok_s`` lists all).
    ``on_run(row)`` is called when a setting's row is final (live tables / plots). Raises
    ``ValueError`` for an unknown knob or ``repeats < 1``."""
    if knob not in SWEEPS:
        raise ValueError(f"unknown knob {knob!r}; knobs: {', '.join(SWEEPS)}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    wl = knob_workload(knob, num_requests, seed)
    values = SWEEPS[knob] if values is None else list(values)
    if warmup:
        serve({k: v[:2] for k, v in wl.items()}, model=model, device=device, max_tokens=4, **BASE[knob])
    best: list[dict[str, Any] | None] = [None] * len(values)
    runs: list[list[float]] = [[] for _ in values]
    rows: list[dict[str, Any]] = []
    first = None
    for rep in range(repeats):
        for j, v in enumerate(values):
            label, kw = _setting(knob, v)
            res = serve(wl, model=model, device=device, seed=seed, **{**BASE[knob], **kw})
            runs[j].append(res["throughput_tokens_per_s"])
            tok_s = res["throughput_tokens_per_s"]
            kept = best[j]
            if kept is None or tok_s > kept["throughput_tokens_per_s"]:
                kept = best[j] = res
            if rep < repeats - 1:
                continue
            res = kept
            toks = res.pop("token_ids")
            if first is None:
                first = toks
            if knob == "sampling":
                res["same_as_first"] = sum(a == b for a, b in zip(toks, first)) / len(toks)
            row = {"knob": knob, "value": v, "label": label, **res, "runs_tok_s": runs[j]}
            rows.append(row)
            if on_run is not None:
                on_run(row)
    return rows


def format_row(r: dict[str, Any]) -> str:
    """One line of the knob table (ms, tokens/s, %)."""
    s = (
        f"{r['label']:22s} {r['throughput_tokens_per_s']:7.0f} tok/s  TTFT p50/p99 "
        f"{r['ttft_s']['p50'] * 1e3:6.0f}/{r['ttft_s']['p99'] * 1e3:6.0f} ms  TPOT p50/p99 "
        f"{(r['tpot_s']['p50'] or 0) * 1e3:5.1f}/{(r['tpot_s']['p99'] or 0) * 1e3:5.1f} ms  "
        f"KV peak {r['kv_usage_peak']:4.0%}  preempt {r['num_preemptions']:3d}  "
        f"tokens {r['num_output_tokens']:5d}"
    )
    if r["knob"] == "sampling":
        samp = r["sampling_s_per_step"]
        s += (
            f"  sampling {samp * 1e3 if samp is not None else float('nan'):.2f} ms/step  "
            f"distinct-2 {r['distinct_2']:.2f}  rep-4gram {r['repeated_4gram']:.2f}  "
            f"same as greedy {r['same_as_first']:.0%}"
        )
    if r["knob"] == "max_model_len":
        s += (
            f"  KV {r['kv_cache_bytes'] / 2**20:5.1f} MiB ({r['num_gpu_blocks']} blocks)  "
            f"rejected {r['rejected']}  truncated {r['truncated']}"
        )
    if r["knob"] == "chunked_prefill":
        s += f"  largest step {r['max_step_tokens']} tok, longest {r['max_step_s'] * 1e3:.0f} ms"
    return s
