"""The OpenAI-compatible HTTP API (FastAPI): routes, authentication, errors.

Routes, as vLLM's OpenAI server offers them:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` for server-sent events);
- ``GET /v1/models``: the one served model (``--served-model-name``);
- ``GET /health``: 200 while every engine loop runs, else 503;
- ``GET /metrics``: Prometheus text (:mod:`llmlab.serve.metrics`).

With ``api_key`` every ``/v1/*`` request needs ``Authorization: Bearer <key>`` (401 otherwise);
``/health`` and ``/metrics`` stay open. Errors are OpenAI error bodies
(:func:`~llmlab.serve.protocol.error_body`): malformed JSON and bad fields 400, unknown model 404,
a full waiting queue or a stopping server 503. A request never stops the server: every failure
is answered on its own connection.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmlab.serve import responses as R
from llmlab.serve.async_engine import EngineStoppedError, QueueFullError
from llmlab.serve.chat import ChatRenderer
from llmlab.serve.metrics import CONTENT_TYPE_LATEST
from llmlab.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from llmlab.serve.router import Router

DISCONNECT_POLL_S = 0.5      # how often a non-streamed request checks that its client is still there


def build_app(engines: list, *, served_model_name: str, chat_template: str | None = None,
              api_key: str | None = None, metrics=None) -> FastAPI:
    """The app over started-or-not :class:`AsyncEngine` replicas (started at app startup if
    needed, shut down at app shutdown). ``chat_template``: Jinja source overriding the
    tokenizer's. ``metrics``: the :class:`ServerMetrics` the engines report to."""
    router = Router(engines)
    first = engines[0].engine
    tokenizer, max_model_len = first.tokenizer, first.max_model_len
    renderer = ChatRenderer(tokenizer, chat_template) if tokenizer is not None else None
    created = int(time.time())

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

    app = FastAPI(title="llmlab", lifespan=lifespan)
    app.state.engines, app.state.router = engines, router

    # --- errors and auth ------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        errs = exc.errors()
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                        for e in errs) or "invalid request"
        param = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return JSONResponse(error_body(msg, 400, param or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), 500)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(error_body("invalid or missing API key", 401), status_code=401)
        return await call_next(request)

    # --- plain routes ---------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        ok = all(e.is_running for e in engines)
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route():
        if metrics is None:
            raise APIError("metrics are not enabled on this server", 404)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model",
                                            "created": created, "owned_by": "llmlab",
                                            "max_model_len": max_model_len}]}

    # --- generation -----------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(f"The model `{name}` does not exist (this server serves "
                           f"`{served_model_name}`).", 404, "model")

    def params_for(req, ids: list[int], requested: int | None):
        max_tokens = requested if requested is not None else max(1, max_model_len - len(ids))
        if len(ids) + max_tokens > max_model_len:
            raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, "
                           f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                           f"{max_tokens} for the completion). Please reduce the length of the "
                           "prompt or max_tokens.", param="max_tokens")
        return req.sampling_params(max_tokens)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        prompts = []
        for p in req.prompts():
            try:
                text, ids = first.encode(p)
            except ValueError as e:
                raise APIError(str(e), param="prompt") from None
            if req.echo and text is None and tokenizer is not None:
                text = tokenizer.decode(ids)
            prompts.append((text if req.echo else "", ids, params_for(req, ids, req.max_tokens)))
        return await generate(raw, req, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        if renderer is None:
            raise APIError("this model has no tokenizer: chat completions need one")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            _, ids = renderer.render(messages, req.add_generation_prompt)
        except APIError:
            raise
        except Exception as e:                      # a template error is the request's fault
            raise APIError(f"chat template failed: {e}", param="messages") from None
        return await generate(raw, req, [("", ids, params_for(req, ids, req.requested_max_tokens()))],
                              chat=True)

    async def generate(raw: Request, req, prompts: list, chat: bool):
        rid = R.new_id("chatcmpl" if chat else "cmpl")
        streams = []
        try:
            for i, (_, ids, params) in enumerate(prompts):
                streams.append(await router.pick().add_request(ids, params, f"{rid}-{i}"))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, ValueError):
                raise APIError(str(e)) from None
            if isinstance(e, (QueueFullError, EngineStoppedError)):
                raise APIError(str(e), 503) from None
            raise
        n = req.n
        echo = [p[0] for p in prompts]
        num_prompt = sum(len(p[1]) for p in prompts)
        k = prompts[0][2].logprobs
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = _stream_body(rid, streams, n, echo, num_prompt, chat, include_usage, k)
            return _EngineStream(body, streams, media_type="text/event-stream")
        finals = {}
        try:
            async for i, out in _merge(streams, raw):
                if out.finished:
                    finals[i] = out
        except EngineStoppedError as e:
            raise APIError(str(e), 503) from None
        if len(finals) < len(streams):
            return Response(status_code=499)        # the client went away; nothing was generated for it
        failed = [o.error for o in finals.values() if getattr(o, "error", None)]
        if failed:                                  # e.g. non-finite logits: this request only
            raise APIError(f"the request failed in the engine: {failed[0]}", 500)
        choices, num_gen = [], 0
        for i in range(len(streams)):
            for c in finals[i].outputs:
                choices.append({"index": i * n + c.index, "text": echo[i] + (c.text or ""),
                                "finish_reason": c.finish_reason,
                                "logprobs": logprobs_of(c.token_ids, c.logprobs, k, chat, len(echo[i]))})
                num_gen += len(c.token_ids)
        choices.sort(key=lambda c: c["index"])
        return R.completion_response(rid, served_model_name, choices, num_prompt, num_gen, chat)

    def decode(ids) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def logprobs_of(token_ids, logprobs, k, chat, offset):
        if k is None or logprobs is None:
            return None
        if chat:
            return R.chat_logprobs(token_ids, logprobs, decode, k)
        return R.completion_logprobs(token_ids, logprobs, decode, offset)

    async def _stream_body(rid, streams, n, echo, num_prompt, chat, include_usage, k):
        created = int(time.time())
        deltas = R.ChoiceDeltas()
        gen_tokens, lp_sent = {}, {}
        if chat:
            for i in range(len(streams)):
                for j in range(n):
                    yield R.sse(R.chunk(rid, served_model_name, created, i * n + j, None, None,
                                        True, include_usage, role=True))
        try:
            async for i, out in _merge(streams, None):
                if getattr(out, "error", None):
                    yield R.sse(error_body(f"the request failed in the engine: {out.error}", 500))
                    break
                for c in out.outputs:
                    idx = i * n + c.index
                    gen_tokens[idx] = len(c.token_ids)
                    offset = len(deltas.sent.get(idx, ""))
                    d = deltas.delta(idx, echo[i] + (c.text or ""), c.finish_reason)
                    if d is not None:
                        a = lp_sent.get(idx, 0)
                        lp = logprobs_of(c.token_ids[a:], (c.logprobs or [])[a:], k, chat, offset)
                        lp_sent[idx] = len(c.token_ids)
                        yield R.sse(R.chunk(rid, served_model_name, created, idx, d[0], d[1], chat,
                                            include_usage, logprobs=lp))
        except (APIError, RuntimeError) as e:
            status = e.status if isinstance(e, APIError) else 500
            yield R.sse(error_body(str(e), status))
        if include_usage:
            yield R.sse(R.usage_chunk(rid, served_model_name, created, num_prompt,
                                      sum(gen_tokens.values()), chat))
        yield R.sse("[DONE]")

    return app


async def _merge(streams: list, raw: Request | None):
    """``(prompt index, RequestOutput)`` from several request streams as they come. With ``raw``
    the client is checked every ``DISCONNECT_POLL_S`` and the requests aborted when it left."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                q.put_nowait((i, out))
        except BaseException as e:               # noqa: BLE001  (handed to the consumer)
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            try:
                i, out = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if raw is not None and await raw.is_disconnected():
                    return
                continue
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                remaining -= 1
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class _EngineStream(StreamingResponse):
    """A streamed response that aborts its requests however it ends (client gone, cancelled)."""

    def __init__(self, content, streams, **kw):
        super().__init__(content, **kw)
        self._streams = streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()
