"""What every request passes before a route: the ``Host`` allow-list, the request id, the API
key, the body-size limit, and the OpenAI error bodies for everything that goes wrong.

Both middlewares are plain ASGI (no ``BaseHTTPMiddleware``), so a route still sees the client's
``http.disconnect`` the moment it happens.

- :class:`APIKeyMiddleware`: with a key, every route needs ``Authorization: Bearer <key>`` (401
  otherwise) except ``/health`` (and ``/metrics`` when it is made public): also ``/docs``,
  ``/redoc`` and ``/openapi.json``.
- :class:`BodyLimitMiddleware`: a body larger than ``max_bytes`` is answered 413 before it is
  read: at once from its ``Content-Length``, or as soon as a chunked body passes the limit.
- :class:`HostMiddleware`: a ``Host`` header not in the allow-list is a 400 (a web page that
  rebinds its DNS name to 127.0.0.1 cannot drive a keyless server on the learner's machine).
- :class:`RequestIdMiddleware`: every response carries ``x-request-id``: the client's (printable
  ASCII, at most 128 characters) or a new one; the routes use it in their response ``id``.

Error bodies are JSON with non-ASCII escaped, so any string a client sent (a lone surrogate
too) can be echoed in an error without failing to encode.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse as _JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmlab.serve.protocol import APIError, error_body


class JSONResponse(_JSONResponse):
    """A JSON response with non-ASCII escaped (``\\udXXX`` for a lone surrogate): it always
    encodes, whatever string it echoes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


class APIKeyMiddleware:
    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.open_paths = app, open_paths
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                return await _send_json(send, 401, error_body("invalid or missing API key", 401))
        return await self.app(scope, receive, send)


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether the ``Host`` header value ``host`` (``name``, ``name:port``, ``[v6]:port``)
    matches an ``allowed`` entry: ``*``, a name (any port) or ``name:port`` (that port)."""
    host = host.strip().lower()
    if "*" in allowed:
        return True
    m = re.fullmatch(r"(\[[0-9a-f:.]+\]|[^:\[\]]+)(?::(\d+))?", host)
    return m is not None and (m.group(1) in allowed or host in allowed)


class HostMiddleware:
    """400 for a request whose ``Host`` is not in ``allowed`` (see :func:`host_allowed`)."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, tuple(h.lower() for h in allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            raw = dict(scope.get("headers") or []).get(b"host", b"")
            host = raw.decode("latin-1")
            if not host_allowed(host, self.allowed):
                return await _send_json(
                    send,
                    400,
                    error_body(
                        f"Host {host!r} is not allowed (--allowed-hosts: {', '.join(self.allowed)})",
                        400,
                        "host",
                    ),
                )
        return await self.app(scope, receive, send)


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


class RequestIdMiddleware:
    """``x-request-id`` on every response: the client's, or a new one (``scope["llmlab.request_id"]``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        got = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = got if _REQUEST_ID.fullmatch(got) else uuid.uuid4().hex
        scope["llmlab.request_id"] = rid

        async def with_id(msg):
            if msg["type"] == "http.response.start":
                msg = {
                    **msg,
                    "headers": [
                        *(h for h in msg.get("headers", []) if h[0].lower() != b"x-request-id"),
                        (b"x-request-id", rid.encode()),
                    ],
                }
            await send(msg)

        return await self.app(scope, receive, with_id)


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> dict:
        return error_body(
            f"the request body is larger than the limit of {self.max_bytes} bytes (--max-request-body-bytes)",
            413,
            "max_request_body_bytes",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _send_json(send, 413, self._error())
        seen, started = 0, False

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:  # FastAPI re-raises HTTPException
                    raise HTTPException(413, self._error()["error"]["message"])
            return msg

        async def tracking_send(msg):
            nonlocal started
            started |= msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except HTTPException as e:  # read outside a route's body parsing
            if e.status_code != 413 or started:
                raise
            await _send_json(send, 413, self._error())


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI error bodies: :class:`APIError` with its status, validation errors 400 naming the
    field, HTTP errors with theirs, anything else 500 (answered on its own connection)."""

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        errs = exc.errors()
        msg = (
            "; ".join(
                f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs
            )
            or "invalid request"
        )
        param = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return JSONResponse(error_body(msg, 400, param or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), 500)
