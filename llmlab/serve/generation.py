"""One generation request over HTTP, shared by ``/v1/completions`` and ``/v1/chat/completions``:
admit its prompts to the replicas, then answer it whole or as a server-sent-event stream.

A :class:`Prompt` is what a route made of one prompt: the text to echo, the token ids, the
engine's ``SamplingParams``. Every prompt of the request is admitted (all or none); a request
that fails in the engine (e.g. its sampler raised) is answered with its error, on its own
connection; the server goes on.

Disconnects: a non-streamed request listens for the client's ``http.disconnect`` while it waits
(:func:`merge`), a stream is cancelled by Starlette when its client leaves; either way every
prompt's request is aborted, which the engine applies before its next step.

Slow readers (:class:`~llmlab.serve.config.ServerConfig`): at most ``max_concurrent_streams``
streams are open (one more is a 503); a stream whose client takes no chunk for
``stream_timeout_s`` seconds is cut (its connection aborted) and its requests aborted. While a
client reads slowly, each of its prompts holds one pending output (the engine's
:class:`~llmlab.serve.async_engine.Mailbox`) and :func:`merge` one more: never a backlog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from llmlab.inference.sampling import SamplingParams
from llmlab.serve import responses as R
from llmlab.serve.async_engine import EngineStoppedError, QueueFullError
from llmlab.serve.context import ServingContext
from llmlab.serve.protocol import APIError, error_body, param_of

log = logging.getLogger("llmlab.serve")
# an ASGI scope extension the server's HTTP protocol adds: abort this connection now
ABORT_CONNECTION = "llmlab.abort_connection"


@dataclass
class Prompt:
    echo: str  # text put before the generated text ("" without echo)
    token_ids: list[int]
    params: SamplingParams
    mm: object = None  # the images' MultimodalState (llmlab.serve.images), token_ids expanded


@dataclass
class _Job:
    ctx: ServingContext
    rid: str
    streams: list
    prompts: list[Prompt]
    n: int
    chat: bool
    k: int | None  # top logprobs per token, None: no logprobs
    echo_logprobs: bool  # completions echo + logprobs: the prompt's too

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def logprobs(self, cursor: R.LogprobCursor, c, end: int):
        """The logprobs of choice ``c``'s tokens newly inside its text of length ``end``."""
        if self.k is None or c.logprobs is None:
            return None
        a, b, offset = cursor.advance(c.token_ids, c.logprobs, self.ctx.decode, end)
        if self.chat:
            return R.chat_logprobs(c.token_ids[a:b], c.logprobs[a:b], self.ctx.decode, self.k)
        return R.completion_logprobs(c.token_ids[a:b], c.logprobs[a:b], self.ctx.decode, offset)

    def prompt_logprobs(self, i: int, out):
        """Completions ``echo`` + ``logprobs``: the prompt tokens' entries (first: None)."""
        if not self.echo_logprobs or out.prompt_logprobs is None:
            return None
        return R.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.ctx.decode, 0)


async def generate(
    ctx: ServingContext, raw: Request, req, prompts: list[Prompt], chat: bool, echo_logprobs: bool = False
):
    """Admit ``prompts`` and answer: a JSON response, or a streamed one with ``req.stream``.
    The response's ``id`` carries the request's ``x-request-id``."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id(raw)}"
    for p in prompts:
        try:
            ctx.engine.check_limits(p.params)
        except ValueError as e:
            raise APIError(str(e), param=param_of(str(e))) from None
    if not req.stream:
        streams = await _admit(ctx, rid, prompts, ctx.adapter_for(req.model))
        job = _Job(ctx, rid, streams, prompts, req.n, chat, prompts[0].params.logprobs, echo_logprobs)
        return await _whole(job, raw)
    limit = ctx.server.max_concurrent_streams
    if ctx.open_streams >= limit:
        raise APIError(
            f"{ctx.open_streams} streams are open (--max-concurrent-streams={limit}); retry later",
            503,
            "max_concurrent_streams",
        )
    ctx.open_streams += 1  # until the response ends, however it ends
    try:
        streams = await _admit(ctx, rid, prompts, ctx.adapter_for(req.model))
    except BaseException:
        ctx.open_streams -= 1
        raise
    job = _Job(ctx, rid, streams, prompts, req.n, chat, prompts[0].params.logprobs, echo_logprobs)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return _EngineStream(_stream_body(job, include_usage), streams, ctx, media_type="text/event-stream")


def request_id(raw: Request) -> str:
    """The request's id: its ``x-request-id`` (set by the request-id middleware), else new."""
    return raw.scope.get("llmlab.request_id") or R.new_id("req").partition("-")[2]


async def _admit(ctx: ServingContext, rid: str, prompts: list[Prompt], lora: str | None = None) -> list:
    streams = []  # engine ids "<id>-<prompt>": an x-request-id in use is a 400, as vLLM
    try:
        for i, p in enumerate(prompts):
            prompt = (
                p.token_ids if p.mm is None else {"prompt_token_ids": p.token_ids, "multi_modal_state": p.mm}
            )
            streams.append(await ctx.router.pick().add_request(prompt, p.params, f"{rid}-{i}", lora=lora))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, ValueError):
            raise APIError(str(e), param=param_of(str(e))) from None
        if isinstance(e, (QueueFullError, EngineStoppedError)):
            raise APIError(str(e), 503) from None
        if isinstance(e, KeyError):  # its LoRA adapter was unloaded meanwhile
            raise APIError(f"The model `{lora}` does not exist.", 404, "model") from None
        raise
    return streams


async def _whole(job: _Job, raw: Request):
    finals = {}
    try:
        async for i, out in merge(job.streams, raw):
            if out.finished:
                finals[i] = out
    except EngineStoppedError as e:
        raise APIError(str(e), 503) from None
    if len(finals) < len(job.streams):
        return Response(status_code=499)  # the client went away; nothing was generated for it
    failed = [o.error for o in finals.values() if getattr(o, "error", None)]
    if failed:  # e.g. non-finite logits: this request only
        raise APIError(f"the request failed in the engine: {failed[0]}", 500)
    choices, num_gen = [], 0
    for i, p in enumerate(job.prompts):
        out = finals[i]
        for c in out.outputs:
            text = p.echo + (c.text or "")
            lp = job.logprobs(R.LogprobCursor(len(p.echo)), c, len(text))
            pre = job.prompt_logprobs(i, out)
            if pre is not None:
                lp = R.join_completion_logprobs(pre, lp)
            choices.append(
                {"index": i * job.n + c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": lp}
            )
            if out.prompt_logprobs is not None and not job.echo_logprobs:
                choices[-1]["prompt_logprobs"] = R.vllm_prompt_logprobs(out.prompt_logprobs)
            num_gen += len(c.token_ids)
    choices.sort(key=lambda c: c["index"])
    return R.completion_response(
        job.rid, job.ctx.served_model_name, choices, job.num_prompt_tokens, num_gen, job.chat
    )


async def _stream_body(job: _Job, include_usage: bool):
    name, created, n = job.ctx.served_model_name, int(time.time()), job.n
    deltas = R.ChoiceDeltas()
    gen_tokens: dict[int, int] = {}
    cursors: dict[int, R.LogprobCursor] = {}
    if job.chat:
        for idx in range(len(job.streams) * n):
            yield R.sse(R.chunk(job.rid, name, created, idx, None, None, True, include_usage, role=True))
    try:
        async for i, out in merge(job.streams, None):
            if getattr(out, "error", None):
                yield R.sse(error_body(f"the request failed in the engine: {out.error}", 500))
                break
            for c in out.outputs:
                idx = i * n + c.index
                gen_tokens[idx] = len(c.token_ids)
                d = deltas.delta(idx, job.prompts[i].echo + (c.text or ""), c.finish_reason)
                if d is None:
                    continue
                first = idx not in cursors
                cursor = cursors.setdefault(idx, R.LogprobCursor(len(job.prompts[i].echo)))
                lp = job.logprobs(cursor, c, len(deltas.sent[idx]))
                if first and (pre := job.prompt_logprobs(i, out)) is not None:
                    lp = R.join_completion_logprobs(pre, lp)
                yield R.sse(
                    R.chunk(job.rid, name, created, idx, d[0], d[1], job.chat, include_usage, logprobs=lp)
                )
    except (APIError, RuntimeError) as e:
        status = e.status if isinstance(e, APIError) else 500
        yield R.sse(error_body(str(e), status))
    if include_usage:
        yield R.sse(
            R.usage_chunk(job.rid, name, created, job.num_prompt_tokens, sum(gen_tokens.values()), job.chat)
        )
    yield R.sse("[DONE]")


async def _wait_disconnect(raw: Request) -> None:
    """Return when the client of ``raw`` disconnects (its ``http.disconnect`` message)."""
    while True:
        msg = await raw.receive()
        if msg["type"] == "http.disconnect":
            return


async def merge(streams: list, raw: Request | None):
    """``(prompt index, RequestOutput)`` from several request streams as they come. With ``raw``
    the client's disconnect ends it at once; the requests are then aborted."""
    q: asyncio.Queue = asyncio.Queue(maxsize=len(streams))  # bounded: a slow consumer

    # leaves the newest in each mailbox
    async def pump(i, s):
        try:
            async for out in s:
                await q.put((i, out))
        except Exception as e:  # noqa: BLE001  (handed to the consumer; not a cancellation)
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    gone = asyncio.create_task(_wait_disconnect(raw)) if raw is not None else None
    remaining = len(streams)
    try:
        while remaining:
            get = asyncio.ensure_future(q.get())
            done, _ = await asyncio.wait(
                [get] + ([gone] if gone else []), return_when=asyncio.FIRST_COMPLETED
            )
            if get not in done:
                get.cancel()
                return  # the client left
            i, out = get.result()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                remaining -= 1
            yield i, out
    finally:
        for t in tasks + ([gone] if gone else []):
            t.cancel()
        for s in streams:
            s.abort()


class SlowReaderError(Exception):
    """The client took no chunk for ``stream_timeout_s`` seconds."""


class _EngineStream(StreamingResponse):
    """A streamed response that aborts its requests however it ends (client gone, cancelled, or
    too slow to read: no chunk taken for ``stream_timeout_s``, then its connection is aborted)."""

    def __init__(self, content, streams, ctx: ServingContext, **kw):
        super().__init__(content, **kw)
        self._streams, self._ctx = streams, ctx

    async def __call__(self, scope, receive, send):
        timeout = self._ctx.server.stream_timeout_s

        async def timed_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise SlowReaderError() from None

        try:
            await super().__call__(scope, receive, timed_send)
        except BaseException as e:  # a slow reader is cut here
            if not _is_slow_reader(e):
                raise
            log.warning(
                "a client read nothing for %.1f s (--stream-timeout-s): disconnected, its request aborted",
                timeout,
            )
            abort = (scope.get("extensions") or {}).get(ABORT_CONNECTION)
            if abort is None:
                raise SlowReaderError("the client stopped reading") from None
            abort()
            await asyncio.sleep(0)  # let uvicorn see the connection is gone
        finally:
            await self.body_iterator.aclose()  # the body's merge() stops its tasks now
            for s in self._streams:
                s.abort()
            self._ctx.open_streams -= 1


def _is_slow_reader(e: BaseException) -> bool:
    if isinstance(e, SlowReaderError):
        return True
    group = getattr(e, "exceptions", None) or ()  # an exception group (anyio's task group)
    return bool(group) and all(_is_slow_reader(x) for x in group)
