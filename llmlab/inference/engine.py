"""The engine loop: schedule, run, sample, stop (``LLM`` in :mod:`llmlab.inference.llm` wraps it).

``LLMEngine.step()`` is one iteration (Orca's iteration-level scheduling): the scheduler plans
(which sequences, how many tokens, which block copies), the model runner computes those tokens
through the paged cache, every sequence whose last token was computed samples its next token, and
finished sequences give their blocks back.

Per token: the logits are checked finite (a NaN or inf fails that request only,
``finish_reason="error"``), processed (``min_tokens``, penalties) and sampled
(:mod:`~llmlab.inference.sampling`), then detokenised and checked for the stop conditions
(:mod:`~llmlab.inference.stop_checker`).
A checkpoint's ``generation_config.json`` fills the sampling fields a request leaves unset.

Metrics: ``engine.step_metrics`` holds one :class:`StepMetrics` per step (batch size, tokens, KV
blocks used, preemptions, ...), ``on_step`` receives each as it is made, and every
:class:`RequestOutput` carries :class:`RequestMetrics` (arrival, first scheduled, first token and
finish times, seconds from ``time.perf_counter``), from which TTFT and TPOT follow.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmlab.inference import loader
from llmlab.inference.batched_greedy import greedy_tokens, is_plain_greedy
from llmlab.inference.block_manager import BlockManager
from llmlab.inference.engine_config import SWAP_SPACE_BYTES, EngineConfig, resolve
from llmlab.inference.errors import EngineDeadError
from llmlab.inference.model_runner import ModelRunner, kv_bytes_per_block
from llmlab.inference.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,  # noqa: F401
    RequestOutput,
    StepMetrics,
)
from llmlab.inference.sampling import (
    SamplingParams,
    filled,
    make_generator,
    process_logits,
    sample_token,
    top_logprobs,
)
from llmlab.inference.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmlab.inference.sequence import Sequence
from llmlab.inference.stop_checker import StopChecker
from llmlab.metrics.profiling import TraceRecorder, phase
from llmlab.model.config import ModelConfig
from llmlab.runtime.hardware import resolve_device

# A request's prompt: text, token ids, or a request dict ({"prompt": ...} or {"prompt_token_ids":
# [...]}, a vision-language model's with "multi_modal_data"; LLMEngine.encode).
Prompt = str | list[int] | dict[str, Any]


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and (
            len(self.seqs) == self.params.n or any(s.finish_reason in ("abort", "error") for s in self.seqs)
        )


def default_host_blocks(
    num_gpu_blocks: int, bytes_per_block: int, swap_space_bytes: int = SWAP_SPACE_BYTES
) -> int:
    """Host (swap) blocks by default: ``min(num_gpu_blocks, swap_space_bytes // bytes_per_block)``.
    Raises ``ValueError`` for a negative ``swap_space_bytes`` or a non-positive block size."""
    if swap_space_bytes < 0 or bytes_per_block <= 0:
        raise ValueError(
            f"swap_space_bytes={swap_space_bytes} must be >= 0 and bytes_per_block={bytes_per_block} > 0"
        )
    return min(num_gpu_blocks, swap_space_bytes // bytes_per_block)


def default_gpu_blocks(
    cfg: EngineConfig, model_config: ModelConfig, max_model_len: int, device: torch.device
) -> int:
    """Device blocks when ``num_gpu_blocks`` is not given: room for ``max_num_seqs`` full-length
    sequences, capped by ``kv_cache_memory_bytes`` (64 MiB on CPU, 40% of free memory on CUDA),
    and at least one full-length sequence."""
    budget = cfg.kv_cache_memory_bytes
    if budget is None:
        budget = int(0.4 * torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else 64 * 2**20
    per_block = kv_bytes_per_block(model_config, cfg.block_size, cfg.dtype)
    one_seq = math.ceil(max_model_len / cfg.block_size)
    return max(one_seq, min(cfg.max_num_seqs * one_seq, budget // per_block))


def _validate_layout(cfg: EngineConfig, model_config: Any, distributed: bool) -> None:
    """The parallel layout's checks (``ValueError`` naming the size): the pipeline's (every rank
    a worker, :mod:`~llmlab.inference.pipeline_parallel`) or tensor parallelism's alone."""
    if distributed:
        from llmlab.inference import pipeline_parallel

        pipeline_parallel.validate(
            model_config, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.quantization
        )
    elif cfg.tensor_parallel_size != 1:
        from llmlab.inference import tensor_parallel

        tensor_parallel.validate(model_config, cfg.tensor_parallel_size, cfg.quantization)


def _cache_sizes(
    cfg: EngineConfig, mc: Any, max_model_len: int, device: torch.device
) -> tuple[int, str, int]:
    """``(num_gpu_blocks, preemption_mode, num_host_blocks)``: the KV cache pools (the config's,
    else sized from memory) and how a preempted sequence is resumed (swap on CUDA, else recompute)."""
    num_gpu_blocks = cfg.num_gpu_blocks or default_gpu_blocks(cfg, mc, max_model_len, device)
    preemption_mode = cfg.preemption_mode or ("swap" if device.type == "cuda" else "recompute")
    num_host_blocks = cfg.num_host_blocks
    if num_host_blocks is None:
        block_bytes = kv_bytes_per_block(mc, cfg.block_size, cfg.dtype)
        swap = preemption_mode == "swap"
        num_host_blocks = (
            default_host_blocks(num_gpu_blocks, block_bytes, cfg.swap_space_bytes) if swap else 0
        )
    return num_gpu_blocks, preemption_mode, num_host_blocks


def _make_runner(
    model: Any,
    spec: Any,
    cfg: EngineConfig,
    device: torch.device,
    num_gpu_blocks: int,
    num_host_blocks: int,
    distributed: bool,
) -> Any:
    """The runner of the layout: a :class:`ModelRunner` in this process, the tensor-parallel
    ranks, or the pipeline's workers (``spec``: what each worker loads)."""
    cache = dict(
        num_blocks=num_gpu_blocks,
        block_size=cfg.block_size,
        dtype=cfg.dtype,
        num_host_blocks=num_host_blocks,
        paged_attention=cfg.paged_attention,
        cpu_fused=cfg.cpu_fused,
    )
    if distributed:
        from llmlab.inference import pipeline_parallel

        tp, pp, backend = (
            cfg.tensor_parallel_size,
            cfg.pipeline_parallel_size,
            cfg.distributed_executor_backend,
        )
        return pipeline_parallel.launch(model, spec, tp, pp, device, cache, backend)
    if cfg.tensor_parallel_size != 1:
        from llmlab.inference import tensor_parallel

        return tensor_parallel.TensorParallelRunner.launch(
            model, spec, cfg.tensor_parallel_size, device, cache
        )
    runner = ModelRunner(
        model,
        num_gpu_blocks,
        cfg.block_size,
        device,
        cfg.dtype,
        num_host_blocks,
        paged_attention=cfg.paged_attention,
        packed_linear=cfg.packed_linear,
        cpu_fused=cfg.cpu_fused,
    )
    if cfg.quantization == "w8a8":  # after the runner fused q/k/v and gate/up
        from llmlab.inference.quantize_w8a8 import quantize_w8a8

        quantize_w8a8(runner.model)
    return runner


def _prepare_quantization(model: Any, tokenizer: Any, cfg: EngineConfig) -> None:
    """What quantisation does to ``model`` (in place) before the runner fuses it: int8 weights
    (``int8-weight-only``), or for ``w8a8`` SmoothQuant's smoothing (``smoothquant_alpha > 0``,
    calibrated on the start of the bundled corpus, :mod:`llmlab.inference.smooth_quant`; the int8
    layers come after the runner fused q/k/v and gate/up, :func:`_make_runner`)."""
    if cfg.quantization in ("int8", "int8-weight-only"):
        from llmlab.model.quantize import quantize_int8

        quantize_int8(model)  # in place: every linear but lm_head
    elif cfg.quantization == "w8a8" and cfg.smoothquant_alpha > 0:
        from llmlab.inference import smooth_quant

        ids = smooth_quant.calibration_ids(tokenizer, model.config.vocab_size)
        smooth_quant.smooth(model, ids, cfg.smoothquant_alpha)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Settings: an :class:`~llmlab.inference.engine_config.EngineConfig` (``config``), or its
    fields as keywords (``LLMEngine(model, block_size=8)``; with ``config`` too, they replace its
    fields). Their meaning, vLLM's: ``block_size`` tokens per block; ``num_gpu_blocks`` blocks in
    the device cache (default :func:`default_gpu_blocks`); ``num_host_blocks`` host blocks for
    swap preemption (default when ``preemption_mode == "swap"``: as many as fit in
    ``swap_space_bytes``, 4 GiB like vLLM's ``swap_space``, and no more than the device blocks; the
    host cache is pinned memory on CUDA); ``max_num_seqs``, ``max_num_batched_tokens`` (default
    ``max(2048, max_model_len)``), ``enable_prefix_caching``, ``enable_chunked_prefill``,
    ``preemption_mode`` (``"recompute"``, or ``"swap"``, the default on CUDA); ``max_model_len``
    (default, and at most: the model's ``max_position_embeddings``); ``dtype`` of weights and
    cache (default fp32); ``quantization="int8-weight-only"`` (alias ``"int8"``) stores every
    linear weight but the output head as int8 with per-output-channel scales
    (:mod:`llmlab.model.quantize`), ``"w8a8"`` also quantises their inputs per token and multiplies
    in int8 (:mod:`llmlab.inference.quantize_w8a8`; a model object passed in is quantised in
    place), after SmoothQuant's smoothing with migration strength ``smoothquant_alpha`` (0: none;
    :mod:`llmlab.inference.smooth_quant`); ``seed`` for requests without one;
    ``check_invariants`` verifies the block pool after every step (tests); ``on_step(StepMetrics)``
    hook;
    ``tensor_parallel_size`` ranks the model is sharded over, this process being rank 0
    (:mod:`llmlab.inference.tensor_parallel`; :meth:`shutdown` stops the other ranks);
    ``pipeline_parallel_size`` stages of ``tensor_parallel_size`` ranks each, all of them workers
    started by ``distributed_executor_backend`` (``"mp"`` processes or ``"ray"`` actors; either
    backend with ``pipeline_parallel_size > 1``, and ``"ray"`` always, goes through
    :mod:`llmlab.inference.pipeline_parallel`, up to one step in flight per stage); the
    request limits ``max_n``, ``max_logprobs``, ``max_stop_strings``, ``max_stop_string_chars``,
    ``max_tokens_limit``, checked by :meth:`add_request`.

    ``generation_defaults`` (default: the checkpoint's ``generation_config.json``, see
    :func:`~llmlab.inference.loader.generation_defaults`) fill the sampling fields a request
    leaves unset.

    A request whose sampling or forward pass fails (an exception, non-finite logits) finishes
    alone with ``finish_reason="error"`` and its ``error``; its blocks return to the pool and the
    engine goes on with the others.

    Raises ``ValueError`` for inconsistent sizes and, in :meth:`add_request`, for requests that
    can never run (empty prompt, longer than the context or than the whole cache, bad ids, over
    a limit).
    """

    def __init__(
        self,
        model: loader.ModelSpec = "shakespeare",
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        **engine_args: Any,
    ) -> None:
        cfg = resolve(config, engine_args)  # (checked once, when made)
        self.config = cfg
        self.device = torch.device(resolve_device(str(cfg.device)))  # auto: a GPU if any
        spec = model
        model, self.tokenizer, eos_token_ids, defaults = loader.load(model, tokenizer)
        self.generation_defaults = dict(
            defaults if cfg.generation_defaults is None else cfg.generation_defaults
        )
        distributed = cfg.pipeline_parallel_size > 1 or cfg.distributed_executor_backend == "ray"
        _validate_layout(cfg, model.config, distributed)  # every rank a worker when distributed
        _prepare_quantization(model, self.tokenizer, cfg)
        self.quantization = cfg.quantization
        self.mm_config = getattr(model, "mm_config", None)  # a vision-language model's
        if self.mm_config is not None and cfg.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 does not support vision-language models")
        mc = self.model_config = model.config
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={mc.max_position_embeddings}"
            )
        num_gpu_blocks, preemption_mode, num_host_blocks = _cache_sizes(
            cfg, mc, self.max_model_len, self.device
        )
        self.block_size = cfg.block_size
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens or max(2048, self.max_model_len),
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            preemption_mode=preemption_mode,
        )  # (the Scheduler checks it)
        self.block_manager = BlockManager(
            num_gpu_blocks, cfg.block_size, cfg.enable_prefix_caching, num_host_blocks
        )
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.runner: Any = _make_runner(  # ModelRunner, TensorParallelRunner or PipelineExecutor
            model, spec, cfg, self.device, num_gpu_blocks, num_host_blocks, distributed
        )
        self.tensor_parallel_size = cfg.tensor_parallel_size
        self.distributed = distributed
        # pipeline: (step plan, handle, t0, cow copies before)
        self._in_flight: list[tuple[SchedulerOutput, Any, float, int]] = []
        self._next_virtual_engine = 0
        self.check_invariants = cfg.check_invariants
        self.stopper = StopChecker(self.tokenizer, list(eos_token_ids), self.max_model_len)
        self.on_step = cfg.on_step
        self.step_metrics: list[StepMetrics] = []
        self.requests: dict[str, _Request] = {}
        self._rng = random.Random(cfg.seed)
        self._ids = itertools.count()
        self._step = 0
        self.profiler = TraceRecorder(cfg.profile_dir)

    def start_profile(self) -> None:
        """Start recording a PyTorch profiler trace of the steps that follow (vLLM's
        ``start_profile``), in the thread that calls :meth:`step`. ``RuntimeError`` without
        ``profile_dir`` or while recording."""
        self.profiler.start()

    def stop_profile(self) -> str:
        """Stop recording; returns the trace's path (``profile_dir/engine-N.pt.trace.json.gz``)."""
        return self.profiler.stop()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks or the pipeline's workers, if any (idempotent)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids (from the checkpoint's generation config or config)."""
        return self.stopper.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Iterable[int]) -> None:
        self.stopper.eos_token_ids = list(ids)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps submitted whose logits have not come back (pipeline parallelism; else 0)."""
        return len(self._in_flight)

    @property
    def num_gpu_blocks(self) -> int:
        return self.block_manager.num_blocks

    # --- requests --------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """``prompt``: text, a list of token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids":
        [...]}``. Returns (text or None, token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a request needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, [int(t) for t in prompt]

    def check_limits(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the first request limit of :attr:`config` that ``params``
        exceed (``max_n``, ``max_logprobs``, ``max_stop_strings``, ``max_stop_string_chars``,
        ``max_tokens_limit``), or a token id outside the vocabulary."""
        cfg = self.config
        stops = filled(params.stop, "stop")  # a list once SamplingParams is made
        checks = [
            ("n", params.n, cfg.max_n, "max_n"),
            ("logprobs", params.logprobs or 0, cfg.max_logprobs, "max_logprobs"),
            ("prompt_logprobs", params.prompt_logprobs or 0, cfg.max_logprobs, "max_logprobs"),
            ("stop", len(stops), cfg.max_stop_strings, "max_stop_strings"),
            (
                "stop",
                max(map(len, stops), default=0),
                cfg.max_stop_string_chars,
                "max_stop_string_chars",
            ),
        ]
        if cfg.max_tokens_limit is not None:
            max_tokens = filled(params.max_tokens, "max_tokens")
            checks.append(("max_tokens", max_tokens, cfg.max_tokens_limit, "max_tokens_limit"))
        for name, value, limit, flag in checks:
            if value > limit:
                raise ValueError(f"{name}: {value} is over the limit {flag}={limit}")
        params.check_vocab(self.model_config.vocab_size)
        if params.prompt_logprobs is not None and self.tensor_parallel_size != 1:
            raise ValueError("prompt_logprobs: not supported with tensor_parallel_size > 1")
        if params.prompt_logprobs is not None and not hasattr(self.runner, "execute_with_prompt_logits"):
            raise ValueError(
                f"prompt_logprobs: not supported by this engine's runner ({type(self.runner).__name__})"
            )

    # --- LoRA adapters (llmlab.inference.lora) ---------------------------------------------------
    def enable_lora(self, max_loras: int, max_lora_rank: int = 16) -> None:
        """Serve up to ``max_loras`` LoRA adapters beside the base (one device, or tensor
        parallelism: each rank its slices of them)."""
        if not isinstance(self.runner, ModelRunner):  # the pipeline: other stages' layers
            raise ValueError(
                "LoRA adapters are served by the one-device and tensor-parallel runners "
                "(not with pipeline parallelism)"
            )
        self.runner.enable_lora(max_loras, max_lora_rank)

    def add_lora(self, name: str, path: str | Path) -> None:
        """Load the PEFT adapter in ``path`` as ``name`` (``ValueError``: no slot free, name
        taken, an adapter for another base; requests name it from the next step on)."""
        if getattr(self.runner, "lora", None) is None:
            raise ValueError("LoRA is not enabled: start with --max-loras N (enable_lora)")
        self.runner.load_lora(name, str(path))

    def remove_lora(self, name: str) -> None:
        """Unload the adapter ``name``: ``KeyError`` when none is loaded by that name,
        ``ValueError`` while unfinished requests use it."""
        lora = getattr(self.runner, "lora", None)  # only the one-device runner has slots
        if lora is None or name not in lora.by_name:
            raise KeyError(name)
        lid = lora.lora_id(name)
        if any(seq.lora_id == lid and not seq.is_finished for r in self.requests.values() for seq in r.seqs):
            raise ValueError(f"adapter {name!r} is in use by unfinished requests")
        self.runner.unload_lora(name)

    def lora_adapters(self) -> dict[str, str]:
        """``{name: folder}`` of the loaded adapters."""
        lora = getattr(self.runner, "lora", None)  # only the one-device runner has slots
        return {} if lora is None else {n: p for n, (_, _, p) in lora.by_name.items()}

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` if it can never be served,
        ``KeyError`` when ``lora`` names no loaded adapter.

        ``params`` fields left unset take the engine's ``generation_defaults`` (recorded in the
        request's outputs as ``sampling_defaults``); ``lora`` runs it with that adapter."""
        lora_id = 0
        if lora is not None:
            if getattr(self.runner, "lora", None) is None or lora not in self.runner.lora.by_name:
                raise KeyError(lora)
            lora_id = self.runner.lora.lora_id(lora)
        params, used = (params or SamplingParams()).with_defaults(self.generation_defaults)
        params.validate()
        self.check_limits(params)
        text, ids = self.encode(prompt)
        mm = None
        if self.mm_config is not None or (
            isinstance(prompt, dict) and (prompt.get("multi_modal_data") or prompt.get("multi_modal_state"))
        ):
            from llmlab.inference import multimodal  # images: expand their placeholders

            ids, mm = multimodal.from_request(prompt, ids, self.mm_config, self.config)
            if mm is not None and params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs: not supported for prompts with images")
        self._check_fits(ids, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = time.perf_counter() if arrival_time is None else arrival_time
        req = _Request(request_id, text, ids, params, RequestMetrics(now), sampling_defaults=used)
        seq = Sequence(
            request_id, ids, params, arrival_time=now, pending_fork=params.n, mm=mm, lora_id=lora_id
        )
        if params.prompt_logprobs is not None:  # filled by the steps computing the prompt
            req.prompt_logprobs = [None]
            seq.skip_prefix_cache = True
        base = params.seed if params.seed is not None else self._rng.getrandbits(62)
        seq.generator = make_generator(base, "cpu")
        seq.seed = base
        self.stopper.start(seq)
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` when the prompt ``ids`` can never run in this engine."""
        if not ids:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        V = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"prompt token ids must be in [0, {V}) (vocab_size={V})")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens is longer than the model's context "
                f"max_model_len={self.max_model_len}"
            )
        # K/V is stored for every token but the last sampled one, which ends the sequence
        max_tokens = filled(params.max_tokens, "max_tokens")
        kv_tokens = max(len(ids), min(len(ids) + max_tokens, self.max_model_len) - 1)
        need = self.block_manager.blocks_for(kv_tokens)
        if need > self.num_gpu_blocks:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{need} KV blocks of {self.block_size} tokens ({kv_tokens} tokens "
                f"with K/V) but the whole cache has num_gpu_blocks="
                f"{self.num_gpu_blocks}; lower max_tokens or add blocks"
            )
        sc = self.scheduler_config
        if not sc.enable_chunked_prefill and len(ids) > sc.max_num_batched_tokens:
            raise ValueError(
                f"prompt of {len(ids)} tokens exceeds max_num_batched_tokens="
                f"{sc.max_num_batched_tokens}; enable chunked prefill or raise the budget"
            )
        if params.n > sc.max_num_seqs:
            raise ValueError(f"n={params.n} samples exceed max_num_seqs={sc.max_num_seqs}")

    def _prompt_logit_seqs(self, out: SchedulerOutput) -> frozenset[int]:
        """The step's sequences still computing prompt positions whose prompt logprobs are wanted."""
        ids: set[int] = set()
        for seq, _ in out.scheduled:
            req = self.requests[seq.request_id]
            if req.prompt_logprobs is not None and len(req.prompt_logprobs) < seq.num_prompt_tokens:
                ids.add(seq.seq_id)
        return frozenset(ids)

    def _add_prompt_logprobs(
        self, out: SchedulerOutput, prompt_logits: dict[int, tuple[int, torch.Tensor]]
    ) -> None:
        """vLLM's ``prompt_logprobs`` from the step's own forward: per prompt token after the
        first, ``{token_id: Logprob}`` of the ``k`` most likely and the actual one under the raw
        log-softmax of the prediction at the previous position. A position computed again
        (recompute after preemption) is not added twice."""
        for seq, _ in out.scheduled:
            if seq.seq_id not in prompt_logits:
                continue
            req = self.requests[seq.request_id]
            first, rows = prompt_logits[seq.seq_id]
            k, ids, have = req.params.prompt_logprobs, seq.prompt_token_ids, req.prompt_logprobs
            if k is None or have is None:  # _prompt_logit_seqs asks only for requests that want them
                raise RuntimeError(f"request {req.request_id}: prompt logits came back unasked")
            for j, row in enumerate(rows):
                if first + j + 1 == len(have):
                    have.append(self._logprob_entry(top_logprobs(row, ids[first + j + 1], k)))

    def _decode_one(self, t: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([t], skip_special_tokens=False)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool."""
        req = self.requests.get(str(request_id))
        if req is None:
            return
        live = [s for s in req.seqs if not s.is_finished]
        for seq in live:
            self.scheduler.finish(seq, "abort")
        if live:
            req.metrics.finish_time = time.perf_counter()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- finishing ------------------------------------------------------------------------------
    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq, reason)
        seq.finish_time = now
        if reason != "abort":
            self.stopper.finish(seq)

    # --- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration (:meth:`_step_once`), named ``llmlab.engine step`` in a profiler trace."""
        with phase("engine step", n=self._step):
            return self._step_once()

    def _step_once(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the requests that changed in it. A forward
        pass that raises fails the requests of this step (``finish_reason="error"``, blocks
        freed); a sampling error fails its request alone. Neither is raised; only
        :class:`~llmlab.inference.errors.EngineDeadError` (the engine cannot step again) is."""
        if self.distributed:
            return self._pipelined_step()
        t0 = time.perf_counter()
        sched, bm = self.scheduler, self.block_manager
        cow_before = bm.stats["cow_copies"]
        with phase("schedule"):
            out = sched.schedule()
        if out.is_empty:
            self._check_progress()
            return []
        self._mark_scheduled(out, t0)
        try:
            self._block_ops(out)
            wanted = self._prompt_logit_seqs(out)
            seqs = [s for s, _ in out.scheduled]
            screened: dict[int, int] = {}
            if isinstance(self.runner, ModelRunner) and self.runner.greedy_screen is not None:
                greedy = frozenset(s.seq_id for s in seqs if is_plain_greedy(s))  # fp32: screened
                logits, prompt_logits, screened = self.runner.execute_greedy(out, wanted, greedy)
                self._add_prompt_logprobs(out, prompt_logits)
            elif wanted:
                logits, prompt_logits = self.runner.execute_with_prompt_logits(out, wanted)
                self._add_prompt_logprobs(out, prompt_logits)
            else:
                logits = self.runner.execute(out)
            fast = greedy_tokens(logits, seqs, self.config.cpu_fused) | screened  # plain greedy
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001  (the step's requests fail, not the engine)
            return self._forward_failed(out, e, t0, cow_before)
        return self._complete(out, logits, fast, t0, cow_before)

    def _check_progress(self) -> None:
        sched, bm = self.scheduler, self.block_manager
        if sched.has_unfinished():
            raise RuntimeError(
                f"scheduler made no progress: {len(sched.waiting)} waiting, "
                f"{len(sched.running)} running, {len(sched.swapped)} swapped, "
                f"{bm.num_free_blocks}/{bm.num_blocks} blocks free"
            )

    def _mark_scheduled(self, out: SchedulerOutput, t0: float) -> None:
        for seq, _ in out.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = t0
                m = self.requests[seq.request_id].metrics
                m.first_scheduled_time = m.first_scheduled_time or t0

    def _block_ops(self, out: SchedulerOutput) -> None:
        self.runner.swap_out(out.swap_out)
        self.runner.swap_in(out.swap_in)
        self.runner.copy_blocks(out.copies)

    def _forward_failed(
        self, out: SchedulerOutput, e: Exception, t0: float, cow_before: int
    ) -> list[RequestOutput]:
        changed = self._fail_step(out, f"the forward pass failed: {type(e).__name__}: {e}")
        self._record(out, t0, cow_before, 0.0)
        return [self._output(r) for r in changed.values()]

    def _pipelined_step(self) -> list[RequestOutput]:
        """A step with up to ``runner.depth`` steps in flight (pipeline parallelism,
        :mod:`llmlab.inference.pipeline_parallel`): schedule and submit one over the sequences not
        in flight, if there is room; then, when the pipeline is full or nothing new could be
        submitted, wait for the oldest step's logits and sample its tokens."""
        flight, submitted = self._in_flight, False
        if len(flight) < self.runner.depth:
            t0, cow = time.perf_counter(), self.block_manager.stats["cow_copies"]
            out = self._schedule_virtual_engine()
            if out is not None:
                self._mark_scheduled(out, t0)
                flight.append((out, self.runner.submit(out), t0, cow))
                submitted = True
        if not flight:
            self._check_progress()
            return []
        if submitted and len(flight) < self.runner.depth:
            return []
        out, handle, t0, cow = flight.pop(0)
        try:
            logits = self.runner.collect(handle)
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001  (the step's requests fail, not the engine)
            return self._forward_failed(out, e, t0, cow)
        # requests aborted (and maybe released) while their step was in flight: nothing to sample
        out.scheduled = [
            (s, n) for s, n in out.scheduled if not s.is_finished and s.request_id in self.requests
        ]
        return self._complete(
            out, logits, greedy_tokens(logits, [s for s, _ in out.scheduled], self.config.cpu_fused), t0, cow
        )

    def _schedule_virtual_engine(self) -> SchedulerOutput | None:
        """The next step of a pipeline: the running sequences are split into ``depth`` groups by
        id (vLLM's virtual engines, one scheduler each there); the next group in turn that has
        work and is not in flight is scheduled (new requests join whichever step admits them).
        Returns the step, or None when nothing can run now."""
        depth = self.runner.depth
        busy = frozenset(s.seq_id for o, *_ in self._in_flight for s, _ in o.scheduled)
        for k in range(depth):
            ve = (self._next_virtual_engine + k) % depth
            others = frozenset(s.seq_id for s in self.scheduler.running if s.seq_id % depth != ve)
            out = self.scheduler.schedule(busy | others)
            self._block_ops(out)  # queued; they travel with the next step
            if not out.is_empty:
                self._next_virtual_engine = ve + 1
                return out
        return None

    def _complete(
        self,
        out: SchedulerOutput,
        logits: dict[int, torch.Tensor],
        fast: dict[int, int],
        t0: float,
        cow_before: int,
    ) -> list[RequestOutput]:
        """After the forward: the scheduled tokens are computed; sample, stop, record."""
        sched, bm = self.scheduler, self.block_manager
        sched.update(out)
        now = time.perf_counter()
        changed: dict[str, _Request] = {}
        sample_s = 0.0
        with phase("sampling"):
            for seq, n in out.scheduled:
                if seq.num_computed_tokens < seq.num_tokens:
                    continue  # mid-prompt chunk: no token
                req = self.requests[seq.request_id]
                changed[req.request_id] = req
                group = self._fork(req, seq)
                try:
                    sample_s += self._sample_group(
                        req, group, logits.get(seq.seq_id), now, fast.get(seq.seq_id)
                    )
                except Exception as e:  # noqa: BLE001  (this request fails alone)
                    req.error = f"sampling failed: {type(e).__name__}: {e}"
                    for s in group:
                        if not s.is_finished:
                            self._finish(s, "error", now)
        for req in changed.values():
            if req.finished:
                req.metrics.finish_time = now
        if self.check_invariants:
            bm.check_invariants([s for s in sched.live_sequences()])
        self._record(out, t0, cow_before, sample_s)
        return [self._output(r) for r in changed.values()]

    def _fail_step(self, out: SchedulerOutput, message: str) -> dict[str, _Request]:
        """Finish every request of a step whose forward pass failed, with ``message``."""
        now = time.perf_counter()
        changed: dict[str, _Request] = {}
        for seq in [s for s, _ in out.scheduled] + list(out.preempted):
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            req.error = req.error or message
            for s in req.seqs:
                if not s.is_finished:
                    self._finish(s, "error", now)
            req.metrics.finish_time = now
            changed[req.request_id] = req
        return changed

    def _fork(self, req: _Request, seq: Sequence) -> list[Sequence]:
        """``seq`` and, right after its prompt, the other ``n - 1`` samples forked from it."""
        group = [seq]
        if seq.pending_fork > 1:
            children = self.scheduler.fork(seq, seq.pending_fork)
            for child in children:
                child.generator = make_generator(seq.seed + child.sample_index, "cpu")
                self.stopper.start(child)
            req.seqs += children
            group += children
        return group

    def _sample_group(
        self,
        req: _Request,
        group: list[Sequence],
        row: torch.Tensor | None,
        now: float,
        greedy_token: int | None = None,
    ) -> float:
        """Sample the next token of each sequence of ``group`` from ``row [V]`` and check their
        stops; returns the seconds spent sampling. Non-finite logits fail the request.
        ``greedy_token``: the first sequence's token already taken by the step's batched argmax
        (:mod:`llmlab.inference.batched_greedy`; its row was checked finite there) or by the
        runner's greedy screen (:mod:`llmlab.inference.greedy_screen`: then ``row`` is None)."""
        if row is None and (greedy_token is None or len(group) > 1 or group[0].params.logprobs is not None):
            raise RuntimeError("the runner returned no logits for a sequence that samples from them")
        # one reduction as the fast check (a NaN or inf makes the sum non-finite), exact after
        if (
            row is not None
            and greedy_token is None
            and not math.isfinite(float(row.sum()))
            and not bool(torch.isfinite(row).all())
        ):
            bad = "nan" if bool(torch.isnan(row).any()) else "inf"
            req.error = (
                f"non-finite logits ({bad}) at output position "
                f"{group[0].num_output_tokens}; the request was stopped"
            )
            for s in group:
                self._finish(s, "error", now)
            return 0.0
        sample_s = 0.0
        for s in group:
            ts = time.perf_counter()
            p = s.params
            stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            if s is group[0] and greedy_token is not None:
                tok = greedy_token
            else:
                assert row is not None  # (checked above)
                x = process_logits(row, p, s.prompt_token_ids, s.output_token_ids, stop_ids)
                tok = sample_token(x, p, s.generator)
            if p.logprobs is not None:  # once per new token, never rebuilt
                assert row is not None  # (checked above)
                lp = self._logprob_entry(top_logprobs(row, tok, p.logprobs))
                s.logprobs.append(lp)
                s.cumulative_logprob += lp[tok].logprob
            s.append_token(tok)
            sample_s += time.perf_counter() - ts
            if s.first_token_time is None:
                s.first_token_time = now
                req.metrics.first_token_time = req.metrics.first_token_time or now
            reason = self.stopper.check(s)
            if reason is not None:
                self._finish(s, reason, now)
        return sample_s

    def _record(self, out: SchedulerOutput, t0: float, cow_before: int, sample_s: float) -> None:
        bm, sched, bs = self.block_manager, self.scheduler, self.block_size
        stored: dict[int, int] = {}  # block -> tokens with K/V in it
        for seq in sched.running:
            for i, b in enumerate(seq.block_table):
                f = max(0, min(bs, seq.num_computed_tokens - i * bs))
                stored[b] = max(stored.get(b, 0), f)
        self._step += 1
        m = StepMetrics(
            step=self._step,
            start_time=t0,
            duration_s=time.perf_counter() - t0,
            num_seqs=len(out.scheduled),
            num_batched_tokens=out.num_batched_tokens,
            num_prefill_tokens=sum(n for _, n in out.scheduled if n > 1),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            num_preemptions=len(out.preempted),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            kv_tokens_stored=sum(stored.values()),
            block_size=bs,
            num_cow_copies=bm.stats["cow_copies"] - cow_before,
            num_prefix_hit_tokens=bm.stats["prefix_hit_tokens"],
            seq_lens=tuple(s.num_computed_tokens for s in sched.running),
            sample_s=sample_s,
        )
        self.step_metrics.append(m)
        if self.on_step is not None:
            self.on_step(m)

    def _output(self, req: _Request) -> RequestOutput:
        seqs = sorted(req.seqs, key=lambda s: s.sample_index)
        m = req.metrics
        m.num_preemptions = sum(s.num_preemptions for s in seqs)
        m.num_prefix_cached_tokens = max(s.num_prefix_cached_tokens for s in seqs)
        m.num_output_tokens = max(s.num_output_tokens for s in seqs)
        outs = [
            CompletionOutput(
                s.sample_index,
                list(s.output_token_ids),
                self.stopper.visible_text(s),
                s.finish_reason,
                self._logprobs(s),
                s.cumulative_logprob if s.params.logprobs is not None else None,
            )
            for s in seqs
        ]
        return RequestOutput(
            req.request_id,
            req.prompt,
            list(req.prompt_token_ids),
            outs,
            req.finished,
            m,
            error=req.error,
            sampling_defaults=dict(req.sampling_defaults),
            prompt_logprobs=req.prompt_logprobs,
        )

    def _logprob_entry(self, d: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        """One position's ``{token_id: Logprob}`` (with each token's text), built once."""
        return {t: Logprob(v, r, self._decode_one(t)) for t, (v, r) in d.items()}

    def _logprobs(self, seq: Sequence) -> list[dict[int, Logprob]] | None:
        """The sequence's logprobs so far: the entries made when each token was sampled (a new
        list of the same entries, so each step costs one pointer per token, nothing rebuilt)."""
        return None if seq.params.logprobs is None else list(seq.logprobs)

    def block_tables(self) -> dict[str, list[int]]:
        """``{"<request_id>.<sample>": block_table}`` of the sequences holding device blocks."""
        return {f"{s.request_id}.{s.sample_index}": list(s.block_table) for s in self.scheduler.running}

    def get_output(self, request_id: str) -> RequestOutput:
        return self._output(self.requests[str(request_id)])

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (its blocks are already back in the pool)."""
        self.requests.pop(str(request_id), None)
