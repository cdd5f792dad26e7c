"""``llmlab serve``: an OpenAI-compatible HTTP server on the paged-KV-cache engine (see CONTRACT.md).

    llmlab serve                                         # the shipped shakespeare model, 127.0.0.1:8000
    llmlab serve --model DIR --served-model-name qwen --port 8080 --api-key secret
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 32, "temperature": 0}'

Prints ``llmlab serve: serving NAME at http://HOST:PORT`` once it listens (with ``--port 0``, the
port the OS chose). SIGTERM or Ctrl-C: stop admitting, let running requests finish (at most
``--shutdown-timeout`` s, then abort them), exit 0.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from llmlab.inference.engine_config import EngineConfig, add_engine_arguments, from_args
from llmlab.serve.config import add_server_arguments, server_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p)
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 when this many requests wait (default: no limit)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, requests routed to the least-loaded (default 1)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish on SIGTERM (default 30)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's log level (info and debug also log each request)",
    )
    p.add_argument(
        "--allow-special-tokens-in-chat",
        action="store_true",
        help="parse special tokens written inside chat message content as the "
        "template's markers (default: off, so a message cannot forge a turn)",
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write the serving gauges (/metrics) as TensorBoard scalars to DIR, every second",
    )
    p.add_argument(
        "--public-metrics",
        action="store_true",
        help="with --api-key, let /metrics answer without the key (default: off)",
    )
    _add_lora_arguments(p)
    add_server_arguments(p.add_argument_group("HTTP server (ServerConfig fields)"))
    g = p.add_argument_group("engine (EngineConfig fields; the limits answer 4xx naming the flag)")
    add_engine_arguments(
        g,
        None,
        {
            "tensor_parallel_size": {
                "help": "ranks the model is sharded over (with --data-parallel-size > 1: only with "
                "--distributed-executor-backend ray or --pipeline-parallel-size > 1)"
            }
        },
    )


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What is served and where: ``--model``, ``--served-model-name``, ``--host``, ``--port``,
    ``--api-key``, ``--chat-template``."""
    p.add_argument(
        "--model",
        default="shakespeare",
        help="checkpoint directory (HF Llama/Qwen2 or llmlab) or a preset with shipped "
        "weights (default: shakespeare, bundled)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the checkpoint folder's name, or the preset)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for all)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("LLMLAB_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health (and "
        "/metrics with --public-metrics) (default: $LLMLAB_API_KEY)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="Jinja chat template (default: the tokenizer's, else a plain 'role: text' one)",
    )


def _add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """``--lora-modules``, ``--max-loras``, ``--max-lora-rank`` (vLLM's names; llmlab/serve/lora.py)."""
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=DIR",
        help="PEFT LoRA adapters served beside the base; a request's model NAME picks one",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapters loaded at once (default: as many as --lora-modules; with it, "
        "POST /v1/load_lora_adapter loads more at run time)",
    )
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (default 16)")


def engine_config(args) -> EngineConfig:
    """The :class:`~llmlab.inference.engine_config.EngineConfig` of the engine flags."""
    return from_args(args)


def validate(args) -> None:
    """Raise ``ValueError`` naming the bad flag, before any model is loaded."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [0, 65535]")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} must be >= 1")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} must be >= 1")
    if (
        args.tensor_parallel_size > 1
        and args.data_parallel_size > 1
        and args.pipeline_parallel_size == 1
        and args.distributed_executor_backend == "mp"
    ):
        raise NotImplementedError(
            "--tensor-parallel-size > 1 with --data-parallel-size > 1 needs "
            "--distributed-executor-backend ray or --pipeline-parallel-size "
            "> 1 (one mp tensor-parallel engine per server process)"
        )
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests {args.max_waiting_requests} must be >= 1")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout} must be >= 0")
    from llmlab.serve.lora import parse_lora_modules

    modules = parse_lora_modules(args.lora_modules)
    if args.max_loras is not None and not 1 <= len(modules) <= args.max_loras and modules:
        raise ValueError(f"--lora-modules gives {len(modules)} adapters but --max-loras is {args.max_loras}")
    if args.max_loras is not None and args.max_loras < 1:
        raise ValueError(f"--max-loras {args.max_loras} must be >= 1")
    if args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank {args.max_lora_rank} must be >= 1")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if args.tensorboard:
        from llmlab.metrics.profiling import check_dir

        check_dir(args.tensorboard, "--tensorboard")
    try:
        engine_config(args)
        server_config(args)
    except ValueError as e:  # name the flag: "max_n=0 must be ..." -> "--max-n 0 must be ..."
        name, _, rest = str(e).partition("=")
        raise ValueError(f"--{name.replace('_', '-')} {rest}" if rest else str(e)) from None


def run(args: argparse.Namespace) -> int:
    validate(args)
    _check_serve_extra()
    from llmlab.serve import build_engines, default_served_name
    from llmlab.serve.lora import parse_lora_modules
    from llmlab.serve.app import build_app
    from llmlab.serve.chat import load_template
    from llmlab.serve.metrics import ServerMetrics
    from llmlab.serve.server import bind_socket, make_server

    template = load_template(args.chat_template)
    name = args.served_model_name or default_served_name(args.model)
    config = engine_config(args)
    http = server_config(args)
    metrics = ServerMetrics(name, device_type=_device_type(args.device))
    try:  # before any model is loaded: a taken port fails at once, nothing to stop
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        hint = " (--port 0 picks a free port)" if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}{hint}") from None
    try:
        engines = build_engines(
            args.model,
            data_parallel_size=args.data_parallel_size,
            max_waiting_requests=args.max_waiting_requests,
            metrics=metrics,
            config=config,
        )
        modules = parse_lora_modules(args.lora_modules)
        if modules or args.max_loras:
            from llmlab.serve.lora import enable

            enable(engines, modules, args.max_loras or len(modules), args.max_lora_rank)
    except BaseException:
        sock.close()
        raise
    app = build_app(
        engines,
        served_model_name=name,
        chat_template=template,
        api_key=args.api_key,
        metrics=metrics,
        public_metrics=args.public_metrics,
        allow_special_tokens_in_chat=args.allow_special_tokens_in_chat,
        server=http,
        allowed_hosts=http.hosts_for(args.host),
    )
    host, port = sock.getsockname()[:2]
    server = make_server(
        app,
        engines,
        log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        send_buffer_bytes=http.send_buffer_bytes,
    )
    _announce(args, name, host, port)
    tb = None
    if args.tensorboard:
        from llmlab.serve.tensorboard import GaugeLogger

        tb = GaugeLogger(metrics, args.tensorboard).start()
    try:
        server.run(sockets=[sock])
    finally:
        for engine in engines:
            engine.shutdown()
        sock.close()
        if tb is not None:
            tb.close()
    print("llmlab serve: stopped", file=sys.stderr, flush=True)
    return 0


def _check_serve_extra() -> None:
    """``NotImplementedError`` naming the missing package of the 'serve' extra."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as e:
        raise NotImplementedError(
            f"llmlab serve needs the 'serve' extra ({e.name} is missing): pip install -e '.[serve]'"
        ) from None


def _announce(args: argparse.Namespace, name: str, host: str, port: int) -> None:
    """The listening line on stdout (tests and scripts wait for it), and a warning on stderr
    when the server listens beyond this machine without an API key."""
    if host not in ("127.0.0.1", "::1", "localhost") and not args.api_key:
        print(
            f"llmlab serve: warning: listening on {host} without --api-key: anyone who can reach "
            "this port can use the model",
            file=sys.stderr,
            flush=True,
        )
    shown = f"[{host}]" if ":" in host else host
    print(
        f"llmlab serve: serving {name} at http://{shown}:{port} "
        f"({args.data_parallel_size} replica{'s' * (args.data_parallel_size > 1)})",
        flush=True,
    )


def _device_type(device: str) -> str:
    from llmlab.runtime.hardware import resolve_device

    return resolve_device(device).split(":")[0]
