"""Running the app under uvicorn: in the foreground (``llmlab serve``) or on a background thread
(tests, notebooks), on a socket bound before the server starts (port 0: an ephemeral port).

Shutdown (SIGTERM or SIGINT in the foreground, :meth:`ServerThread.stop` in the background): the
engines stop admitting (new requests get 503), uvicorn closes the listening socket, requests
already running finish within ``shutdown_timeout`` seconds (after that they are cancelled, which
aborts them and frees their blocks), then the app's shutdown stops the engine loops. The process
exits with status 0 (uvicorn would re-raise the signal after its shutdown; this server does not).
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmlab.serve.generation import ABORT_CONNECTION

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmlab.serve.metrics import ServerMetrics


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: the OS picks a free one).
    Raises ``OSError`` when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class AbortableH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that also hands each request a way to abort its connection
    (``scope["extensions"]["llmlab.abort_connection"]``): a stream whose client stopped reading
    is cut at once, not left waiting for its unread bytes to drain. ``send_buffer_bytes`` (set
    by :func:`make_server`): the kernel send buffer of each connection (``SO_SNDBUF``), so what
    a client that stops reading leaves queued in the kernel is bounded too."""

    send_buffer_bytes: int | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self.send_buffer_bytes is not None and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)

    def handle_events(self) -> None:
        super().handle_events()
        scope = getattr(self, "scope", None)  # the request this call parsed, its task not yet run
        if scope is not None:
            scope.setdefault("extensions", {})[ABORT_CONNECTION] = self.abort_connection

    def abort_connection(self) -> None:
        """Close the connection now with a reset, dropping what the client left unread (a
        plain close would leave the kernel sending it to a client that does not read)."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


class LLMLabServer(uvicorn.Server):
    """uvicorn's server that tells the engines to stop admitting as soon as shutdown starts and
    exits normally on SIGTERM/SIGINT."""

    def __init__(self, config: uvicorn.Config, engines: list):
        super().__init__(config)
        self.engines = engines

    def handle_exit(self, sig, frame) -> None:
        for e in self.engines:
            e.stop_admitting()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, h in original.items():
                signal.signal(s, h)


def make_server(
    app,
    engines: list,
    *,
    log_level: str = "warning",
    shutdown_timeout: float = 30.0,
    send_buffer_bytes: int | None = None,
) -> LLMLabServer:
    """uvicorn's server over ``app`` with :class:`AbortableH11Protocol` (each connection's kernel
    send buffer ``send_buffer_bytes``; None: the OS's autotuning)."""
    protocol = type("AbortableH11Protocol", (AbortableH11Protocol,), {"send_buffer_bytes": send_buffer_bytes})
    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        http=protocol,
        timeout_graceful_shutdown=max(1, int(round(shutdown_timeout))),
        access_log=log_level in ("info", "debug"),
    )
    return LLMLabServer(config, engines)


class ServerThread:
    """The server on a background thread: ``with ServerThread(app, engines) as s: s.url``.

    ``start`` waits until it answers (``TimeoutError`` after ``start_timeout`` s); ``stop`` shuts it
    down and joins the thread (and the engine threads, through the app's shutdown)."""

    # set by llmlab.serve.serve for its callers (notebooks, tests): the app and its metrics
    app: FastAPI
    metrics: ServerMetrics

    def __init__(
        self,
        app,
        engines: list,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 5.0,
        log_level: str = "warning",
        send_buffer_bytes: int | None = None,
    ):
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.engines = engines
        self.server = make_server(
            app,
            engines,
            log_level=log_level,
            shutdown_timeout=shutdown_timeout,
            send_buffer_bytes=send_buffer_bytes,
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="llmlab-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, start_timeout: float = 60.0) -> "ServerThread":
        if self.thread.ident is not None:
            return self  # already started
        atexit.register(self.stop)  # a notebook kernel that exits stops it too
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup (see its log)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server did not start within {start_timeout}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Idempotent; also runs at interpreter exit."""
        atexit.unregister(self.stop)
        for e in self.engines:
            e.stop_admitting()
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(5)
        for e in self.engines:  # if startup never ran the app's shutdown
            e.shutdown()
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
