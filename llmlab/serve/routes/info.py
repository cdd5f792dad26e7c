"""``GET /health`` (200 while every engine loop runs, else 503), ``GET /metrics`` (Prometheus
text, :mod:`llmlab.serve.metrics`), ``GET /v1/models`` (the one served model) and
``GET /v1/models/{id}`` (it, or 404: the ``openai`` client's ``models.retrieve``)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from llmlab.serve.context import get_context
from llmlab.serve.metrics import CONTENT_TYPE_LATEST
from llmlab.serve.protocol import APIError


async def health(raw: Request):
    ok = all(e.is_running for e in get_context(raw).engines)
    return Response(status_code=200 if ok else 503)


async def metrics(raw: Request):
    m = get_context(raw).metrics
    if m is None:
        raise APIError("metrics are not enabled on this server", 404)
    return Response(m.exposition(), media_type=CONTENT_TYPE_LATEST)


def _card(ctx) -> dict:
    return {
        "id": ctx.served_model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "llmlab",
        "root": ctx.served_model_name,
        "parent": None,
        "max_model_len": ctx.max_model_len,
    }


async def models(raw: Request):
    ctx = get_context(raw)
    adapters = [
        {
            "id": n,
            "object": "model",
            "created": ctx.created,
            "owned_by": "llmlab",
            "root": path,
            "parent": ctx.served_model_name,
            "max_model_len": ctx.max_model_len,
        }
        for n, path in ctx.engine.lora_adapters().items()
    ]  # LoRA (serve/lora.py)
    return {"object": "list", "data": [_card(ctx)] + adapters}


async def model(model_id: str, raw: Request):
    ctx = get_context(raw)
    if model_id != ctx.served_model_name:
        raise APIError(f"The model `{model_id}` does not exist.", 404, "model")
    return _card(ctx)
