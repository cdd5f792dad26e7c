"""The OpenAI-compatible HTTP API (FastAPI), assembled: routes, authentication, limits, errors.

Routes, as vLLM's OpenAI server offers them (each a handler in :mod:`llmlab.serve.routes`):

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` for server-sent events);
- ``GET /v1/models`` and ``GET /v1/models/{id}``: the one served model (``--served-model-name``);
- ``POST /tokenize`` and ``POST /detokenize`` (vLLM's): text or chat messages to token ids, and back;
- ``GET /health``: 200 while every engine loop runs, else 503;
- ``GET /metrics``: Prometheus text (:mod:`llmlab.serve.metrics`);
- ``POST /start_profile``, ``POST /stop_profile``: profiler traces (:mod:`llmlab.serve.routes.profile`).

A request whose ``Host`` is not allowed is a 400 before anything else (``allowed_hosts``);
every response carries an ``x-request-id`` (the client's, echoed, or a new one).

With ``api_key`` every route needs ``Authorization: Bearer <key>`` (401 otherwise) except
``/health`` (and ``/metrics`` with ``public_metrics``): ``/docs``, ``/redoc`` and
``/openapi.json`` too. A body over the server's ``max_request_body_bytes`` is a 413 before it is
read. Errors are OpenAI error bodies (:func:`~llmlab.serve.protocol.error_body`): malformed JSON,
bad or unsupported fields and requests over a limit 400 naming the field, unknown model 404, a
full waiting queue or a stopping server 503. A request never stops the server: every failure is
answered on its own connection.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from llmlab.serve.chat import ChatRenderer
from llmlab.serve.config import LOOPBACK_HOSTS, ServerConfig
from llmlab.serve.context import ServingContext
from llmlab.serve.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    HostMiddleware,
    JSONResponse,
    RequestIdMiddleware,
    install_error_handlers,
)
from llmlab.serve.router import Router
from llmlab.serve.routes import chat, completions, info, profile, tokenize


def build_app(
    engines: list,
    *,
    served_model_name: str,
    chat_template: str | None = None,
    api_key: str | None = None,
    metrics=None,
    public_metrics: bool = False,
    allow_special_tokens_in_chat: bool = False,
    routing_policy=None,
    server: ServerConfig | None = None,
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS,
) -> FastAPI:
    """The app over started-or-not :class:`AsyncEngine` replicas (started at app startup if
    needed, shut down at app shutdown). ``chat_template``: Jinja source overriding the
    tokenizer's. ``metrics``: the :class:`ServerMetrics` the engines report to.
    ``allow_special_tokens_in_chat``: special tokens inside message content act as markers.
    ``routing_policy``: the replicas' :class:`~llmlab.serve.router.Router` policy
    (``policy(loads, start) -> index``; default least loaded). ``server``: the HTTP limits
    (:class:`~llmlab.serve.config.ServerConfig`); ``allowed_hosts``: the ``Host`` values served
    (``ServerConfig.hosts_for(bind address)``; default the loopback names)."""
    tokenizer = engines[0].engine.tokenizer
    renderer = (
        ChatRenderer(tokenizer, chat_template, allow_special_tokens_in_chat)
        if tokenizer is not None
        else None
    )
    server = (server or ServerConfig()).validate()
    ctx = ServingContext(
        engines, served_model_name, Router(engines, routing_policy), renderer, metrics, server
    )

    @asynccontextmanager
    async def lifespan(app):
        for e in engines:
            if not e.started:
                e.start()
        try:
            yield
        finally:
            for e in engines:
                e.shutdown()
            ctx.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="llmlab", lifespan=lifespan, default_response_class=JSONResponse)
    app.state.engines, app.state.router, app.state.serving = engines, ctx.router, ctx
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server.max_request_body_bytes)
    if api_key:
        open_paths = ("/health", "/metrics") if public_metrics else ("/health",)
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(HostMiddleware, allowed=tuple(allowed_hosts))  # added last: runs first
    app.add_api_route("/health", info.health, methods=["GET"])
    app.add_api_route("/metrics", info.metrics, methods=["GET"])
    app.add_api_route("/v1/models", info.models, methods=["GET"])
    from llmlab.serve import lora  # LoRA adapters at run time (vLLM's routes)

    app.add_api_route("/v1/load_lora_adapter", lora.load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", lora.unload_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/models/{model_id:path}", info.model, methods=["GET"])
    app.add_api_route("/tokenize", tokenize.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenize.detokenize, methods=["POST"])
    app.add_api_route("/v1/completions", completions.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat.chat_completions, methods=["POST"])
    app.add_api_route("/start_profile", profile.start_profile, methods=["POST"])
    app.add_api_route("/stop_profile", profile.stop_profile, methods=["POST"])
    return app
