"""What every route handler needs, built once per app: the engines and their router, the served
name, the tokenizer and chat renderer, the limits (the engines'
:class:`~llmlab.inference.engine_config.EngineConfig` and the server's
:class:`~llmlab.serve.config.ServerConfig`), and the one thread that tokenizes.

Tokenizing and rendering chat templates run on :attr:`ServingContext.tokenizer_pool` (one
thread: Hugging Face tokenizers are not safe to call from several threads at once), never on the
event loop, so a long prompt does not stop ``/health`` or other clients' streams.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from llmlab.serve.chat import ChatRenderer
from llmlab.serve.config import ServerConfig
from llmlab.serve.protocol import APIError
from llmlab.serve.router import Router

if TYPE_CHECKING:
    from llmlab.serve.metrics import ServerMetrics


@dataclass
class ServingContext:
    engines: list
    served_model_name: str
    router: Router
    renderer: ChatRenderer | None
    metrics: ServerMetrics | None = None
    server: ServerConfig = field(default_factory=ServerConfig)
    open_streams: int = 0  # streamed responses running (max_concurrent_streams)
    created: int = field(default_factory=lambda: int(time.time()))
    tokenizer_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, "llmlab-tokenize")
    )

    @property
    def engine(self):
        """The first replica's :class:`~llmlab.inference.LLMEngine` (they are all alike)."""
        return self.engines[0].engine

    @property
    def config(self):
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers (1 for the byte-level
        tokenizer; for an HF tokenizer the longest token string, special tokens included)."""
        tok = self.tokenizer
        vocab = getattr(tok, "get_vocab", None)
        if tok is None or vocab is None:
            return 1
        return max([1] + [len(t.encode("utf-8", "surrogatepass")) for t in vocab()])

    async def off_loop(self, fn, *args):
        """``fn(*args)`` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def adapter_for(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (``None``: the base model)."""
        return name if name is not None and name in self.engine.lora_adapters() else None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name and self.adapter_for(name) is None:
            raise APIError(
                f"The model `{name}` does not exist (this server serves `{self.served_model_name}`).",
                404,
                "model",
            )

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def max_tokens_for(self, num_prompt: int, requested: int | None) -> int:
        """``max_tokens`` of a request (what the context leaves when not given, capped by
        ``max_tokens_limit``); raises :class:`APIError` when prompt + max_tokens exceed the
        context."""
        cap = self.config.max_tokens_limit
        max_tokens = requested
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - num_prompt)
            max_tokens = min(max_tokens, cap) if cap is not None else max_tokens
        if num_prompt + max_tokens > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt + max_tokens} tokens ({num_prompt} "
                f"in the prompt, {max_tokens} for the completion). Please reduce the "
                "length of the prompt or max_tokens.",
                param="max_tokens",
            )
        return max_tokens


def get_context(request: Request) -> ServingContext:
    return request.app.state.serving
