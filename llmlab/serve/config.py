"""``ServerConfig``: the HTTP server's own settings (the engine's are
:class:`~llmlab.inference.engine_config.EngineConfig`), each a ``llmlab serve`` flag.

- ``max_request_body_bytes``: a larger body is a 413 before it is read.
- ``max_prompts_per_request``: prompts in one ``/v1/completions`` request.
- ``max_concurrent_streams``: streamed responses open at once; one more is a 503.
- ``stream_timeout_s``: seconds a streamed response may wait for its client to take the next
  chunk; a client that reads nothing for that long is disconnected and its request aborted (its
  KV blocks freed).
- ``send_buffer_bytes``: each connection's kernel send buffer (``SO_SNDBUF``; Linux doubles it
  for its bookkeeping).
- ``allowed_local_media_path``: the directory ``file://`` image URLs may name (vLLM's flag;
  :mod:`llmlab.serve.images`); ``None``: file URLs are refused.
- ``allowed_hosts``: the ``Host`` header values served (DNS-rebinding defence, as Django's
  ``ALLOWED_HOSTS``); ``None``: the loopback names when bound to a loopback address, else any.

What one stalled stream costs the server is bounded: the engine hands its handler only the
newest output (outputs are cumulative, so a newer one replaces the undelivered one), uvicorn
stops taking chunks from the handler once 64 KiB wait in the connection's write buffer, and the
kernel holds at most ``2 * send_buffer_bytes``. So a stalled stream holds, per prompt, at most
two outputs (its token ids, text and logprobs: O(tokens), never O(tokens²)), 64 KiB plus one
chunk and the kernel's buffer, for at most ``stream_timeout_s`` seconds, and at most
``max_concurrent_streams`` such streams exist.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import math
from dataclasses import dataclass

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


@dataclass
class ServerConfig:
    """The HTTP server's limits (sizes in bytes, times in seconds). :meth:`validate` raises
    ``ValueError`` naming the first bad field."""

    max_request_body_bytes: int = 2 * 2**20
    max_prompts_per_request: int = 64
    max_concurrent_streams: int = 256
    stream_timeout_s: float = 60.0
    send_buffer_bytes: int = 256 * 2**10
    allowed_hosts: tuple[str, ...] | None = None
    allowed_local_media_path: str | None = None

    def validate(self) -> "ServerConfig":
        for name in (
            "max_request_body_bytes",
            "max_prompts_per_request",
            "max_concurrent_streams",
            "send_buffer_bytes",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        t = self.stream_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"stream_timeout_s={t!r} must be a finite number > 0")
        if self.allowed_hosts is not None:
            if not self.allowed_hosts or not all(
                isinstance(h, str) and h.strip() for h in self.allowed_hosts
            ):
                raise ValueError(f"allowed_hosts={self.allowed_hosts!r} must list host names (or '*')")
        d = self.allowed_local_media_path
        if d is not None and not os.path.isdir(d):
            raise ValueError(f"allowed_local_media_path={d!r} is not a directory")
        return self

    def hosts_for(self, bind_host: str) -> tuple[str, ...]:
        """The allowed ``Host`` names when bound to ``bind_host``: ``allowed_hosts`` if given,
        else the loopback names for a loopback address, else ``("*",)`` (any)."""
        if self.allowed_hosts is not None:
            return tuple(h.strip().lower() for h in self.allowed_hosts)
        return LOOPBACK_HOSTS if is_loopback(bind_host) else ("*",)


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` and ``localhost``."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


FIELD_HELP = {
    "max_request_body_bytes": "largest HTTP request body, bytes (413 above; default 2 MiB)",
    "max_prompts_per_request": "most prompts in one /v1/completions request (default 64)",
    "max_concurrent_streams": "streamed responses open at once; one more gets 503 (default 256)",
    "stream_timeout_s": "seconds a stream waits for its client to read the next chunk before the "
    "client is disconnected and its request aborted (default 60)",
    "send_buffer_bytes": "kernel send buffer of each connection, bytes (SO_SNDBUF; bounds what a "
    "client that stops reading leaves queued; default 256 KiB)",
}


def add_server_arguments(p) -> None:
    """One flag per field (``max_concurrent_streams`` -> ``--max-concurrent-streams``) and
    ``--allowed-hosts``."""
    defaults = ServerConfig()
    for name, help_ in FIELD_HELP.items():
        kind = float if name.endswith("_s") else int
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=getattr(defaults, name),
            help=help_,
            metavar="X" if kind is float else "N",
        )
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="Host header values served, others get 400 (names, with or without a "
        "port; '*' = any). Default: localhost, 127.0.0.1 and [::1] when bound to "
        "a loopback address, else any",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="directory chat image_url file:// URLs may read images from (default: "
        "none; file URLs are refused)",
    )


def server_config(args) -> ServerConfig:
    """The :class:`ServerConfig` of the flags :func:`add_server_arguments` added."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    if kw.get("allowed_hosts") is not None:
        kw["allowed_hosts"] = tuple(kw["allowed_hosts"])
    return ServerConfig(**kw).validate()


SERVER_FIELDS = frozenset(f.name for f in dataclasses.fields(ServerConfig))
