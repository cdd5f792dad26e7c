"""The Hugging Face baselines of ``llmlab bench serve``, timed like the engine.

- :func:`run_hf`: static batches of ``generate`` (left padding, every row runs the batch's longest
  output; token times from a streamer, as if streamed to the user: HF's best case).
- :func:`run_hf_continuous`: transformers' own continuous batching (``init_continuous_batching``,
  transformers >= 5; :func:`hf_continuous_available` says whether it is there).

Both return the same entry as :func:`llmlab.inference.bench.run_llmlab` (throughput, TTFT/TPOT
percentiles from :mod:`llmlab.inference.metrics`, KV waste, ``token_ids``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from llmlab.inference.metrics import RequestTiming, summarize


class _TimingStreamer:
    """``generate`` streamer: the time of every ``put`` after the prompt (one per new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf(path: str | Path, device: str = "cpu") -> Any:
    """``transformers.AutoModelForCausalLM`` for the checkpoint ``path`` (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    # safetensors only: a pytorch_model.bin is a pickle, which can run code when loaded
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, use_safetensors=True, local_files_only=True
    )
    return model.to(device).eval()


@torch.no_grad()
def hf_greedy(
    hf_model: Any, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | list[int] | None = None
) -> list[list[int]]:
    """Hugging Face's greedy tokens (``generate(do_sample=False)``) for each prompt: prompts of one
    length run as one batch (no padding), each output cut after its first end-of-sequence token
    (``eos_token_id``, default the model's generation config's). The reference the engine's
    temperature-0 tokens are compared with."""
    eos = hf_model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    dev = next(hf_model.parameters()).device
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]  # each filled below: every prompt is in by_len
    for n, idx in by_len.items():
        ids = torch.tensor([prompts[i] for i in idx], device=dev)
        gen = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
        for row, i in zip(gen[:, n:].tolist(), idx):
            cut = next((j for j, t in enumerate(row) if t in eos), None)
            out[i] = row if cut is None else row[: cut + 1]
    return out


@torch.no_grad()
def hf_generate_batch(
    hf_model: Any,
    prompts: list[list[int]],
    num_new: int,
    pad_token_id: int = 0,
    streamer: _TimingStreamer | None = None,
) -> list[list[int]]:
    """Static batch: left-padded ``prompts``, exactly ``num_new`` greedy tokens for every row."""
    dev = next(hf_model.parameters()).device
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, L - len(p) :] = torch.tensor(p)
        mask[r, L - len(p) :] = 1
    out = hf_model.generate(
        input_ids=ids.to(dev),
        attention_mask=mask.to(dev),
        do_sample=False,
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        pad_token_id=pad_token_id,
        eos_token_id=None,
        streamer=streamer,
    )
    new: list[list[int]] = out[:, L:].tolist()
    return new


def run_hf(hf_model: Any, workload: dict[str, Any], arrivals: list[float], batch_size: int) -> dict[str, Any]:
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
        idx = order[b : b + batch_size]
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
        for t in range(1, O + 1):  # cache after decode step t
            stored = sum(len(prompts[i]) + min(t, olens[i]) for i in idx)
            waste_sum += 1.0 - stored / alloc
            waste_steps += 1
    done = [t for t in timings if t is not None]
    if len(done) != n:  # every request is in one batch
        raise RuntimeError(f"static batches timed {len(done)} of {n} requests")
    res = summarize(done)
    res["kv_cache_waste_fraction"] = waste_sum / waste_steps
    res["batch_size"] = batch_size
    res["token_ids"] = tokens
    return res


def hf_continuous_available(hf_model: Any) -> str | None:
    """None when ``hf_model`` has transformers' own continuous batching (``init_continuous_batching``,
    transformers >= 5), else the reason it is skipped."""
    if not hasattr(hf_model, "init_continuous_batching"):
        import transformers

        return (
            f"transformers {transformers.__version__} has no continuous batching "
            f"(model.init_continuous_batching / generate_batch)"
        )
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: F401
    except ImportError as e:  # pragma: no cover - old versions
        return f"transformers has no ContinuousBatchingConfig ({e})"
    return None


def _feed_and_collect(
    manager: Any, prompts: list[list[int]], olens: list[int], arrivals: list[float]
) -> tuple[float, dict[str, Any], dict[str, float]]:
    """Add each request to HF's ``ContinuousBatchingManager`` at its arrival time and collect the
    finished ones: ``(t0, results by request id, time each stream delivered its first token)``.
    ``RuntimeError`` when a request fails or the manager stops answering (60 s)."""
    n = len(prompts)
    order = sorted(range(n), key=lambda i: arrivals[i])
    results: dict[str, Any] = {}  # request id -> HF's finished output
    first_seen: dict[str, float] = {}
    t0 = time.perf_counter()
    k = 0
    while len(results) < n:
        now = time.perf_counter() - t0
        while k < n and arrivals[order[k]] <= now:
            i = order[k]
            manager.add_request(
                prompts[i],
                request_id=str(i),
                max_new_tokens=olens[i],
                record_timestamps=True,
                eos_token_id=-1,
                streaming=True,
            )
            k += 1
        wait = 60.0 if k == n else max(1e-3, arrivals[order[k]] - (time.perf_counter() - t0))
        r = manager.get_result(timeout=min(wait, 60.0))
        if r is None:
            if k == n:
                raise RuntimeError(
                    f"HF continuous batching returned {len(results)}/{n} "
                    f"requests (thread running: {manager.is_running()})"
                )
            continue
        if r.generated_tokens and r.request_id not in first_seen:
            first_seen[r.request_id] = time.perf_counter()
        if r.is_finished():
            if r.error is not None:
                raise RuntimeError(f"HF continuous batching: request {r.request_id}: {r.error}")
            results[r.request_id] = r
    return t0, results, first_seen


def _hf_timings(
    results: dict[str, Any], first_seen: dict[str, float], t0: float, arrivals: list[float], olens: list[int]
) -> tuple[list[RequestTiming], list[list[int]]]:
    """Each request's :class:`RequestTiming` and generated tokens, from HF's results.
    ``RuntimeError`` when a request made another number of tokens than asked."""
    timings, tokens = [], []
    for i in range(len(olens)):
        r = results[str(i)]
        if len(r.generated_tokens) != olens[i]:
            raise RuntimeError(
                f"HF continuous batching: request {i} made {len(r.generated_tokens)} "
                f"tokens, expected {olens[i]}"
            )
        # per-token timestamps restart when HF preempts (offloads) a request; then the first
        # token's time is when its stream delivered it
        ts = r.timestamps or []
        first = ts[0] if len(ts) == olens[i] else first_seen[str(i)]
        finish = ts[-1] if ts else first_seen[str(i)]
        timings.append(RequestTiming(t0 + arrivals[i], first, finish, olens[i]))
        tokens.append(list(r.generated_tokens))
    return timings, tokens


@torch.no_grad()
def run_hf_continuous(
    hf_model: Any,
    workload: dict[str, Any],
    arrivals: list[float],
    *,
    num_blocks: int,
    block_size: int = 16,
    max_batch_tokens: int = 2048,
    max_num_seqs: int = 256,
) -> dict[str, Any]:
    """Serve ``workload`` with transformers' own continuous batching (the engine behind
    ``model.generate_batch``: ``init_continuous_batching`` -> ``ContinuousBatchingManager``, a
    paged cache of ``num_blocks`` whole-model blocks of ``block_size`` tokens, scheduled by a
    background thread). ``generate_batch`` itself takes one ``max_new_tokens`` for all prompts, so
    the requests are added to the same manager one by one, each with its own output length and no
    EOS (``eos_token_id=-1``), at their arrival times, streamed. Token times are the manager's
    per-token timestamps (``time.perf_counter``, like ours); those restart when HF preempts a
    request, and then its first token's time is when its stream delivered it. Same entry as :func:`run_llmlab` plus
    ``kv_cache_bytes`` (HF's cache tensor, trash sectors excluded) and
    ``kv_cache_waste_fraction = None``: HF does not expose its per-step block usage."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts, olens = workload["prompts"], workload["output_lens"]
    gen = GenerationConfig(  # type: ignore[no-untyped-call]  # transformers leaves __init__ unannotated
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(olens)
    )
    cb = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_num_seqs,
    )
    manager = hf_model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        t0, results, first_seen = _feed_and_collect(manager, prompts, olens, arrivals)
        cache = manager.batch_processor.cache if manager.batch_processor is not None else None
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()
    timings, tokens = _hf_timings(results, first_seen, t0, arrivals, olens)
    res = summarize(timings)
    res["kv_cache_waste_fraction"] = None
    res["num_gpu_blocks"] = int(cache.num_blocks) if cache is not None else None
    res["kv_cache_bytes"] = (
        int(cache.cache_tensor.numel() - 2 * cache.bytes_per_sector) if cache is not None else None
    )
    res["token_ids"] = tokens
    return res
