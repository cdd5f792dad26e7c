"""The engine behind the HTTP server: ``LLMEngine`` stepping in its own thread, requests joining
and leaving the running batch between steps.

The HTTP handlers run on an asyncio event loop; the engine steps on one background thread (the
"engine loop", as vLLM's ``AsyncLLM`` output-handler loop): between two steps it takes the
commands handlers queued (add a request, abort one, stop), then runs ``engine.step()`` and hands
each changed :class:`RequestOutput` to the handler's :class:`Mailbox` with
``loop.call_soon_threadsafe`` (the newest output replaces one not yet taken: a slow handler costs
one output, not one per step). Only this thread touches the engine, so the engine needs no locks.

A handler that stops listening (client disconnected, task cancelled) aborts its request; the abort
is applied before the next step and the request's KV blocks go back to the pool.

The engine fails a request whose forward pass or sampling raises by itself (its error in its
output). Should ``engine.step()`` itself raise, the requests in flight are failed and freed and
the loop goes on; only :data:`MAX_CONSECUTIVE_STEP_FAILURES` failing steps in a row, or an
:class:`~llmlab.inference.errors.EngineDeadError` (a tensor-parallel rank exited), stop it
(``/health`` then answers 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
import typing
from dataclasses import dataclass

from llmlab.inference.errors import EngineDeadError

log = logging.getLogger("llmlab.serve")
MAX_CONSECUTIVE_STEP_FAILURES = 3


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` requests (answered 503)."""


class EngineStoppedError(RuntimeError):
    """The engine no longer admits requests (shutting down, or its loop died); answered 503."""


class Mailbox:
    """The newest undelivered item of one request, on its handler's event loop.

    A :class:`RequestOutput` is cumulative (every token, the text and logprobs so far), so a newer
    one replaces one the handler has not taken yet: a handler that stops reading holds one output,
    not one per step. A finished output or an exception is never replaced (nothing follows it)."""

    def __init__(self) -> None:
        self._item: typing.Any = None  # a RequestOutput or the exception that ends the request
        self._full = False
        self._ready = asyncio.Event()

    def put(self, item: typing.Any) -> None:
        if self._full and (isinstance(self._item, BaseException) or self._item.finished):
            return
        self._item, self._full = item, True
        self._ready.set()

    async def get(self) -> typing.Any:
        await self._ready.wait()
        item, self._item, self._full = self._item, None, False
        self._ready.clear()
        return item


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: Mailbox
    num_output_tokens: int = 0
    prompt_counted: bool = False


class RequestStream:
    """One admitted request: ``async for out in stream`` yields its outputs (the last one
    finished); :meth:`abort` (a no-op once finished) frees its blocks before the next step."""

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream):
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self.finished = False
        engine.num_in_flight += 1

    def _done(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.num_in_flight -= 1

    async def __aiter__(self):
        while not self.finished:
            item = await self._stream.queue.get()
            if isinstance(item, BaseException):
                self._done()
                raise item
            if item.finished:
                self._done()
            yield item

    def abort(self) -> None:
        if not self.finished:
            self._done()
            self.engine.abort(self.request_id)


class AsyncEngine:
    """``engine``: an :class:`~llmlab.inference.LLMEngine` (this object owns it from now on).

    ``max_waiting_requests``: refuse a request (:class:`QueueFullError`) when that many wait
    already (None: no limit). ``metrics``: a :class:`~llmlab.serve.metrics.ReplicaMetrics`.
    ``idle_wait_s``: how long the loop sleeps when there is nothing to run (a new command wakes it
    at once). Use :meth:`start` / :meth:`shutdown`, or ``with AsyncEngine(...)``."""

    def __init__(
        self,
        engine,
        *,
        max_waiting_requests: int | None = None,
        metrics=None,
        name: str = "0",
        idle_wait_s: float = 0.5,
    ):
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 1")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.name = name
        self.idle_wait_s = idle_wait_s
        self.num_in_flight = 0  # requests admitted and not yet finished (routing)
        self.num_steps = 0
        self.error: str | None = None  # traceback of the step that failed, if any
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._admitting = True
        self._thread = threading.Thread(target=self._loop, name=f"llmlab-engine-{name}", daemon=True)

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def stop_admitting(self) -> None:
        """New requests get :class:`EngineStoppedError`; running ones go on."""
        self._admitting = False

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what still runs, stop the loop and join its thread (idempotent)."""
        self._admitting = False
        if self._thread.is_alive():
            self._send(("stop",))
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"engine loop {self.name} did not stop within {timeout}s")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # --- requests (called on the event loop) ------------------------------------------------------
    async def call(self, fn):
        """``fn(engine)`` on the engine thread between two steps (loading a LoRA adapter); returns
        its result or raises its exception here."""
        if not self._thread.is_alive():
            return fn(self.engine)  # not started (or stopped): nothing steps
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("run", fn, done))
        return await asyncio.wrap_future(done)

    async def add_request(self, prompt, params, request_id: str, lora: str | None = None) -> "RequestStream":
        """Admit a request before the next step; returns its :class:`RequestStream`.

        ``prompt``: text or token ids. Raises ``ValueError`` (a request the engine can never
        serve), :class:`QueueFullError`, :class:`EngineStoppedError`."""
        if not self._admitting or not self._thread.is_alive():
            raise EngineStoppedError(
                "the server is shutting down" if not self._admitting else "the engine loop is not running"
            )
        stream = _Stream(asyncio.get_running_loop(), Mailbox())
        added: concurrent.futures.Future = concurrent.futures.Future()
        # The request's arrival is now, not when the engine thread picks the command up between two
        # steps: TTFT and end-to-end latency include that wait (lab 11 compares them with the client's).
        self._send(("add", request_id, prompt, params, stream, added, time.perf_counter(), lora))
        await asyncio.wrap_future(added)
        return RequestStream(self, request_id, stream)

    async def generate(self, prompt, params, request_id: str):
        """Yield a :class:`RequestOutput` each time the request changes, the last one finished.
        Closing the generator early aborts the request."""
        rs = await self.add_request(prompt, params, request_id)
        try:
            async for out in rs:
                yield out
        finally:
            rs.abort()

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def start_profile(self) -> None:
        """Start the engine's profiler in the engine thread (the profiler sees its own thread's
        work); ``RuntimeError`` as :meth:`LLMEngine.start_profile`."""
        await self._in_loop("start_profile")

    async def stop_profile(self) -> str:
        """Stop it there; returns the trace's path."""
        return await self._in_loop("stop_profile")

    async def _in_loop(self, method: str):
        if not self._thread.is_alive():
            raise EngineStoppedError("the engine loop is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", method, done))
        return await asyncio.wrap_future(done)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # --- the engine loop (its own thread) ---------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        failures = 0
        while True:
            if not self._apply_commands():
                break
            if engine.has_unfinished_requests():
                t0 = time.perf_counter()
                try:
                    outputs = engine.step()
                    failures = 0
                except Exception as e:
                    failures = (
                        MAX_CONSECUTIVE_STEP_FAILURES if isinstance(e, EngineDeadError) else failures + 1
                    )
                    self._step_failed(
                        traceback.format_exc(),
                        failures,
                        f"the engine stopped: {e}" if isinstance(e, EngineDeadError) else None,
                    )
                    continue
                t1 = time.perf_counter()
                self.num_steps += 1
                last = engine.step_metrics[-1] if engine.step_metrics else None
                engine.step_metrics.clear()  # a server runs for days: keep nothing
                if self.metrics is not None:
                    self.metrics.on_step(last, t0, t1)
                for out in outputs:
                    self._deliver(out)
            else:
                self._wake.wait(self.idle_wait_s)
            self._wake.clear()
            if self.metrics is not None:
                self.metrics.on_state(engine)
        self._abort_all(EngineStoppedError("the server shut down"))
        if self.metrics is not None:
            self.metrics.on_state(engine)
        stop = getattr(engine, "shutdown", None)  # tensor-parallel ranks, if any
        if stop is not None:
            stop()

    def _step_failed(self, tb: str, failures: int, reason: str | None = None) -> None:
        """Fail and free every request in flight (with ``reason``, when known); stop after too
        many failing steps in a row."""
        log.error("engine step failed (%d in a row); failing the requests in flight\n%s", failures, tb)
        self._abort_all(RuntimeError(reason or "the engine step failed; see the server log"))
        for rid in [r for r, req in self.engine.requests.items() if not req.finished]:
            self.engine.abort_request(rid)
            self.engine.release(rid)
        if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            self.error = tb
            self._admitting = False

    def _apply_commands(self) -> bool:
        """Apply queued commands; False when told to stop."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "abort":
                self._abort(cmd[1])
            elif cmd[0] == "run":
                _, fn, done = cmd
                try:
                    done.set_result(fn(self.engine))
                except Exception as e:  # answered to the caller, never fatal
                    done.set_exception(e)
            elif cmd[0] == "call":  # start_profile / stop_profile
                _, method, done = cmd
                try:
                    done.set_result(getattr(self.engine, method)())
                except Exception as e:  # noqa: BLE001  (answered to the caller)
                    done.set_exception(e)
            elif cmd[0] == "stop":
                return False

    def _add(
        self, request_id, prompt, params, stream: _Stream, added, arrival: float, lora: str | None = None
    ) -> None:
        engine = self.engine
        try:
            if not self._admitting:
                raise EngineStoppedError("the server is shutting down")
            waiting = len(engine.scheduler.waiting)
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise QueueFullError(
                    f"{waiting} requests are waiting (--max-waiting-requests="
                    f"{self.max_waiting_requests}); retry later"
                )
            engine.add_request(
                prompt,
                params,
                request_id=request_id,
                arrival_time=arrival,
                **({"lora": lora} if lora is not None else {}),
            )
        except Exception as e:  # ValueError for bad requests; answered, never fatal
            added.set_exception(e)
            return
        self._streams[request_id] = stream
        added.set_result(request_id)

    def _abort(self, request_id: str) -> None:
        if request_id not in self._streams:
            return  # finished already (or never admitted)
        self.engine.abort_request(request_id)
        self._deliver(self.engine.get_output(request_id))

    def _abort_all(self, error: BaseException) -> None:
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            stream = self._streams.pop(rid)
            self.engine.release(rid)
            _put(stream, error)

    def _deliver(self, out) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        n = sum(len(c.token_ids) for c in out.outputs)
        if self.metrics is not None:
            first = not stream.prompt_counted and n > 0
            self.metrics.on_tokens(len(out.prompt_token_ids) if first else 0, n - stream.num_output_tokens)
            stream.prompt_counted |= first
        stream.num_output_tokens = n
        if out.finished:
            del self._streams[out.request_id]
            self.engine.release(out.request_id)
            if self.metrics is not None:
                self.metrics.on_finish(out)
        if not _put(stream, out) and not out.finished:
            self._abort(out.request_id)  # nobody listens any more


def _put(stream: _Stream, item) -> bool:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put, item)
        return True
    except RuntimeError:  # the event loop is closed
        return False
