"""The OpenAI API's request bodies and error body, and their translation to ``SamplingParams``.

Field names and defaults follow the OpenAI API reference (``/v1/completions``,
``/v1/chat/completions``) as vLLM's OpenAI-compatible server accepts them: ``max_tokens`` (16 for
completions; for chat, what is left of ``max_model_len``), ``temperature`` 1.0, ``top_p`` 1.0,
``n`` 1, ``stop``, ``seed``, ``stream`` and ``stream_options.include_usage``; vLLM's extra
sampling fields ``top_k``, ``stop_token_ids``, ``ignore_eos`` (sent by the ``openai`` client in
``extra_body``). Any other field the engine's :class:`SamplingParams` has (e.g. ``min_p``,
``repetition_penalty``, ``prompt_logprobs``) is passed on by name; any other field at all is
refused with a 400 naming it (vLLM ignores them; a field dropped silently is a wrong answer),
and so is a message's own field other than ``role`` and ``content`` unless it is null.
``logit_bias``: ``{"token id": bias in [-100, 100]}`` (OpenAI). Completions: ``echo`` with
``logprobs`` also gives the prompt tokens' log-probabilities (vLLM: ``prompt_logprobs = logprobs``).
Chat: ``add_generation_prompt`` (default true) and ``continue_final_message`` (the last message
is continued, not closed; not both).
Log-probabilities: ``logprobs: K`` (completions) or ``logprobs: true, top_logprobs: K`` (chat),
K <= the engine's ``max_logprobs``, the model's raw log-softmax as the engine reports them.

Errors raised here are :class:`APIError` (HTTP status, OpenAI ``type``, ``param``); the app turns
them into ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from llmlab.inference.sampling import SamplingParams

MAX_LOGPROBS = 20          # the OpenAI API's limit for top_logprobs
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               413: "RequestTooLargeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
# SamplingParams fields a request may not set by name (set from other fields, or internal)
_NOT_BY_NAME = {"n", "max_tokens", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs",
                "temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty",
                "logit_bias"}


def param_of(message: str) -> str | None:
    """The field a ``SamplingParams``/engine error names: ``"top_p=2 must ..."`` -> ``top_p``."""
    m = re.match(r"([a-z_]+)(\[|=|:| )", message)
    known = {f.name for f in dataclasses.fields(SamplingParams)} | {"prompt", "messages"}
    return m.group(1) if m and m.group(1) in known else None


class APIError(Exception):
    """An error answered as an OpenAI error body with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API (and vLLM) answer."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    best_of: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    def num_logprobs(self) -> int | None:
        """How many top log-probabilities each generated token reports (None: no logprobs)."""
        return None

    def check_fields(self) -> None:
        """Raise :class:`APIError` (400) naming a field this server does not implement."""
        names = {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
        for name in self.model_extra or {}:
            if name not in names or name in _NOT_BY_NAME:
                raise APIError(f"{name} is not supported by this server", param=name)
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(f"best_of={self.best_of} is not supported (only best_of == n)",
                           param="best_of")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")

    def sampling_params(self, max_tokens: int, prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; raises :class:`APIError` (400) naming the bad field."""
        self.check_fields()
        k = self.num_logprobs()
        kw: dict[str, Any] = {"n": self.n, "max_tokens": max_tokens, "seed": self.seed,
                              "stop": self.stop, "stop_token_ids": self.stop_token_ids or [],
                              "ignore_eos": self.ignore_eos, "logprobs": k}
        for name in ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        kw.update(self.model_extra or {})
        if prompt_logprobs is not None:
            kw["prompt_logprobs"] = max(prompt_logprobs, kw.get("prompt_logprobs") or 0)
        if self.logit_bias:
            try:
                kw["logit_bias"] = {int(t): b for t, b in self.logit_bias.items()}
            except ValueError:
                raise APIError("logit_bias keys must be token ids", param="logit_bias") from None
        try:
            return SamplingParams(**kw)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param=param_of(str(e))) from None


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids
    or a list of such lists (each prompt is its own request; choices are numbered
    ``prompt_index * n + sample``)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None

    def check_fields(self, i: int) -> None:
        """Raise :class:`APIError` for a field of message ``i`` this server does not implement
        (``name``, ``tool_calls``, ...); null values, as clients echo them back, are fine."""
        for name, value in (self.model_extra or {}).items():
            if value not in (None, [], ""):
                raise APIError(f"messages[{i}].{name} is not supported by this server",
                               param=f"messages.{i}.{name}")

    def text(self) -> str:
        """The content as one string (``{"type": "text"}`` parts joined). Only an assistant
        message may leave it out (as in the OpenAI API); raises ``APIError`` otherwise."""
        if self.content is None:
            if self.role != "assistant":
                raise APIError(f"a {self.role} message needs 'content'", param="messages")
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(f"content part of type {part.get('type')!r} is not supported "
                               "(text only)", param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` rendered by the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_fields(self) -> None:
        super().check_fields()
        for i, m in enumerate(self.messages):
            m.check_fields(i)
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError("Cannot set both continue_final_message and add_generation_prompt to "
                           "true (continue the last message, or open a new one)",
                           param="continue_final_message")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
