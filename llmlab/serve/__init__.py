"""``llmlab serve``: the inference engine behind an OpenAI-compatible HTTP API.

| file | what it holds |
|---|---|
| ``config.py`` | ``ServerConfig``: the HTTP limits (body size, prompts, streams, slow readers, allowed hosts) |
| ``protocol.py`` | the OpenAI request bodies, the error body, request -> ``SamplingParams`` |
| ``chat.py`` | chat messages -> prompt (tokenizer template, ``--chat-template``, plain template) |
| ``async_engine.py`` | ``LLMEngine`` stepping on its own thread; requests join/leave between steps |
| ``router.py`` | data-parallel replicas: least-loaded routing |
| ``responses.py`` | outputs -> OpenAI responses and server-sent-event chunks |
| ``metrics.py`` | ``/metrics``: vLLM v1 names under ``llmlab:``, KV fragmentation, engine busy |
| ``context.py`` | ``ServingContext``: engines, router, renderer, limits, the tokenizer thread |
| ``middleware.py`` | Host allow-list, request ids, API key (every route but ``/health``), body-size limit (413), error bodies |
| ``routes/`` | the handlers: ``info`` (health, metrics, models), ``completions``, ``chat``, ``tokenize`` |
| ``generation.py`` | one generation request: admit, answer whole or streamed, abort on disconnect |
| ``app.py`` | assembles the app from the above |
| ``server.py`` | uvicorn in the foreground or on a thread; clean shutdown |
| ``cli.py`` | ``llmlab serve`` |

From Python (tests, labs)::

    from llmlab.serve import start_server
    with start_server("shakespeare", max_num_seqs=8) as server:   # ephemeral 127.0.0.1 port
        print(server.url)                                           # http://127.0.0.1:PORT

Needs the ``serve`` extra (``pip install -e .[serve]``): fastapi, uvicorn, prometheus_client.
"""

from __future__ import annotations


def default_served_name(model) -> str:
    """``--served-model-name`` default: the checkpoint folder's name, or the preset's name."""
    from pathlib import Path

    if isinstance(model, str):
        p = Path(model).expanduser()
        return p.resolve().name if p.is_dir() else model
    return "llmlab-model"


def build_engines(
    model="shakespeare",
    *,
    data_parallel_size: int = 1,
    max_waiting_requests: int | None = None,
    metrics=None,
    config=None,
    **engine_args,
) -> list:
    """``data_parallel_size`` :class:`AsyncEngine` replicas, each with its own
    :class:`~llmlab.inference.LLMEngine` (weights and KV cache) built from ``config`` (an
    :class:`~llmlab.inference.EngineConfig`) and/or ``engine_args`` (its fields)."""
    import dataclasses

    from llmlab.inference.engine import LLMEngine
    from llmlab.inference.engine_config import resolve
    from llmlab.serve.async_engine import AsyncEngine

    config = resolve(config, engine_args)  # (checked once, when made)
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be >= 1")
    if (
        data_parallel_size > 1
        and config.tensor_parallel_size > 1
        and config.pipeline_parallel_size == 1
        and config.distributed_executor_backend == "mp"
    ):
        raise NotImplementedError(
            "tensor_parallel_size > 1 with data_parallel_size > 1 needs "
            "distributed_executor_backend='ray' or pipeline_parallel_size > 1 "
            "(one mp tensor-parallel engine per server process)"
        )
    if config.distributed_executor_backend == "ray":  # the cluster can hold every replica
        from llmlab.inference import executor_ray

        executor_ray.check_capacity(
            config.tensor_parallel_size, config.pipeline_parallel_size, data_parallel_size
        )
    engines: list = []
    devices = _replica_devices(config.device, data_parallel_size)
    try:
        for r in range(data_parallel_size):
            replica = (
                config if devices[r] == config.device else dataclasses.replace(config, device=devices[r])
            )
            eng = LLMEngine(model, config=replica)
            engines.append(
                AsyncEngine(
                    eng,
                    max_waiting_requests=max_waiting_requests,
                    name=str(r),
                    metrics=None if metrics is None else metrics.replica(str(r)),
                )
            )
    except BaseException:  # nothing left behind: the replicas already started
        for e in engines:
            e.engine.shutdown()
        raise
    return engines


def _replica_devices(device: str, n: int) -> list[str]:
    """One device per replica: with ``cuda`` (or ``auto`` on a CUDA machine) and several GPUs,
    replica ``r`` gets ``cuda:r % num_gpus``; otherwise every replica gets ``device``."""
    from llmlab.runtime.hardware import gpu_count, resolve_device

    if resolve_device(str(device)) == "cuda" and gpu_count() > 1:
        return [f"cuda:{r % gpu_count()}" for r in range(n)]
    return [device] * n


def start_server(
    model="shakespeare",
    *,
    served_model_name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    chat_template: str | None = None,
    data_parallel_size: int = 1,
    max_waiting_requests: int | None = None,
    shutdown_timeout: float = 5.0,
    public_metrics: bool = False,
    allow_special_tokens_in_chat: bool = False,
    routing_policy=None,
    server_config=None,
    lora_modules: dict | None = None,
    max_loras: int = 0,
    max_lora_rank: int = 16,
    **engine_args,
):
    """Build the engines and the app and run them on a background thread; returns the started
    :class:`~llmlab.serve.server.ServerThread` (a context manager: ``stop()`` on exit).
    ``engine_args``: :class:`~llmlab.inference.EngineConfig` fields (or ``config=``), and
    :class:`~llmlab.serve.config.ServerConfig` fields (or ``server_config=``).
    ``routing_policy``: which replica takes a request (:class:`~llmlab.serve.router.Router`).
    ``lora_modules`` ``{name: adapter dir}``, ``max_loras``, ``max_lora_rank``: LoRA adapters
    served beside the base (:mod:`llmlab.serve.lora`)."""
    import dataclasses

    from llmlab.serve.app import build_app
    from llmlab.serve.config import SERVER_FIELDS, ServerConfig
    from llmlab.serve.metrics import ServerMetrics
    from llmlab.serve.server import ServerThread
    from llmlab.runtime.hardware import resolve_device

    server_args = {k: engine_args.pop(k) for k in list(engine_args) if k in SERVER_FIELDS}
    server_config = dataclasses.replace(server_config or ServerConfig(), **server_args).validate()
    name = served_model_name or default_served_name(model)
    config = engine_args.get("config")
    device = str(engine_args.get("device", "auto" if config is None else config.device))
    metrics = ServerMetrics(name, device_type=resolve_device(device).split(":")[0])
    engines = build_engines(
        model,
        data_parallel_size=data_parallel_size,
        max_waiting_requests=max_waiting_requests,
        metrics=metrics,
        **engine_args,
    )
    if lora_modules or max_loras:
        from llmlab.serve.lora import enable

        enable(engines, lora_modules or {}, max_loras or len(lora_modules or {}), max_lora_rank)
    app = build_app(
        engines,
        served_model_name=name,
        chat_template=chat_template,
        api_key=api_key,
        metrics=metrics,
        public_metrics=public_metrics,
        allow_special_tokens_in_chat=allow_special_tokens_in_chat,
        routing_policy=routing_policy,
        server=server_config,
        allowed_hosts=server_config.hosts_for(host),
    )
    server = ServerThread(
        app,
        engines,
        host=host,
        port=port,
        shutdown_timeout=shutdown_timeout,
        send_buffer_bytes=server_config.send_buffer_bytes,
    )
    server.app, server.metrics = app, metrics
    return server.start()
