"""``POST /start_profile`` and ``POST /stop_profile`` (vLLM's): record a PyTorch profiler trace of
every engine replica's steps into the server's ``--profile-dir`` (``engine-N.pt.trace.json.gz``,
named phases: ``llmlab.engine step``, ``schedule``, ``prefill``/``decode``, ``attention``,
``sampling``; docs/profiling.md). Behind the API key like every route; without
``--profile-dir``, or stopping when not recording, a 400 that says so."""

from __future__ import annotations

from fastapi import Request

from llmlab.serve.context import get_context
from llmlab.serve.protocol import APIError


async def start_profile(raw: Request) -> dict:
    engines = get_context(raw).engines
    try:
        for e in engines:
            await e.start_profile()
    except RuntimeError as err:
        raise APIError(str(err), 400) from None
    return {"status": "recording"}


async def stop_profile(raw: Request) -> dict:
    try:
        paths = [await e.stop_profile() for e in get_context(raw).engines]
    except RuntimeError as err:
        raise APIError(str(err), 400) from None
    return {"status": "written", "traces": paths}
