"""LoRA adapters over HTTP, as vLLM's server: ``--lora-modules name=DIR`` at start,
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
``{"lora_name"}`` at run time (behind ``--api-key`` like every route). A request's ``model``
naming an adapter runs with it (:meth:`~llmlab.serve.context.ServingContext.adapter_for`);
``/v1/models`` lists the adapters with the base as their ``parent``. Loading happens on each
replica's engine thread between two steps (:meth:`~llmlab.serve.async_engine.AsyncEngine.call`),
so a request admitted after the answer runs with the adapter. The engine side (slots, per-row
selection, checks against the base) is :mod:`llmlab.inference.lora`.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from llmlab.serve.context import get_context
from llmlab.serve.protocol import APIError


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """``["name=DIR", ...]`` -> ``{name: DIR}``; ``ValueError`` naming ``--lora-modules``."""
    out: dict[str, str] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected name=DIR")
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out[name] = path
    return out


def enable(engines: list[Any], modules: dict[str, str], max_loras: int, max_lora_rank: int) -> None:
    """Before the engines start: LoRA slots on every replica and the ``modules`` loaded.
    ``ValueError`` naming the adapter that does not fit."""
    if len(modules) > max_loras:
        raise ValueError(f"--lora-modules gives {len(modules)} adapters but --max-loras is {max_loras}")
    for e in engines:
        e.engine.enable_lora(max_loras, max_lora_rank)
        for name, path in modules.items():
            e.engine.add_lora(name, path)


async def _body(raw: Request, *fields: str) -> list[str]:
    try:
        body = await raw.json()
    except ValueError:
        raise APIError("the body must be a JSON object", 400) from None
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object", 400)
    for f in fields:
        if not isinstance(body.get(f), str) or not body[f]:
            raise APIError(f"`{f}` must be a non-empty string", 400, f)
    return [body[f] for f in fields]


async def load_lora_adapter(raw: Request) -> dict[str, str]:
    ctx = get_context(raw)
    name, path = await _body(raw, "lora_name", "lora_path")
    if name == ctx.served_model_name:
        raise APIError(f"`{name}` is the base model's name", 400, "lora_name")
    done = []
    try:
        for e in ctx.engines:
            await e.call(lambda eng: eng.add_lora(name, path))
            done.append(e)
    except ValueError as err:
        for e in done:  # all replicas or none
            await e.call(lambda eng: eng.remove_lora(name))
        raise APIError(str(err), 400, "lora_path") from None
    return {"object": "lora_adapter", "id": name, "root": path}


async def unload_lora_adapter(raw: Request) -> dict[str, Any]:
    ctx = get_context(raw)
    (name,) = await _body(raw, "lora_name")
    try:
        for e in ctx.engines:
            await e.call(lambda eng: eng.remove_lora(name))
    except KeyError:
        raise APIError(f"The LoRA adapter `{name}` is not loaded.", 404, "lora_name") from None
    except ValueError as err:
        raise APIError(str(err), 409, "lora_name") from None
    return {"object": "lora_adapter", "id": name, "deleted": True}
