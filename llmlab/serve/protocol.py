"""The OpenAI API's request bodies and error body, and their translation to ``SamplingParams``.

Field names and defaults follow the OpenAI API reference (``/v1/completions``,
``/v1/chat/completions``) as vLLM's OpenAI-compatible server accepts them: ``max_tokens`` (16 for
completions; for chat, what is left of ``max_model_len``), ``temperature`` 1.0, ``top_p`` 1.0,
``n`` 1, ``stop``, ``seed``, ``stream`` and ``stream_options.include_usage``; vLLM's extra
sampling fields ``top_k``, ``stop_token_ids``, ``ignore_eos`` (sent by the ``openai`` client in
``extra_body``) and the engine's other :class:`SamplingParams` fields by name (``min_p``,
``min_tokens``, ``repetition_penalty``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``prompt_logprobs``). Fields clients send by default are accepted and ignored, as vLLM does:
``user``, ``store``, ``metadata``, ``service_tier``, ``safety_identifier``, ``prompt_cache_key``,
``response_format: {"type": "text"}`` and a message's ``name``. Any other field, and any unknown
key inside ``stream_options`` or a content part, is refused with a 400 naming it (a field
dropped silently is a wrong answer), and so is a message's own other field unless it is null.

Types are strict, as JSON has them: an integer field takes only a JSON integer (not ``1.0``,
``true`` or ``"65"``), a number field a JSON number, a string field a string, a text part's
``text`` a string; any other value is a 400 naming the field. A string that is not Unicode text
(a lone surrogate, ``"\\ud800"``) is a 400 naming where it is.
``logit_bias``: ``{"token id": bias in [-100, 100]}`` (OpenAI; ids in ASCII digits). Completions: ``echo`` with
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

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmlab.inference.sampling import SamplingParams

MAX_LOGPROBS = 20  # the OpenAI API's limit for top_logprobs
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


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
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


_STRICT = ConfigDict(extra="allow", strict=True)
_TOKEN_ID = re.compile(r"[0-9]{1,12}")  # logit_bias keys: ASCII digits only


def lone_surrogate_path(value, path: str = "") -> str | None:
    """The path (``messages.0.content``) of the first string (or key) in a parsed JSON value
    that is not valid Unicode text (a lone surrogate), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = (
        value.items() if isinstance(value, dict) else (enumerate(value) if isinstance(value, list) else ())
    )
    for k, v in items:
        sub = f"{path}.{k}" if path else str(k)
        found = lone_surrogate_path(k, sub) if isinstance(k, str) else None
        found = found or lone_surrogate_path(v, sub)
        if found:
            return found
    return None


def refuse_lone_surrogates(data):
    """``data``, or :class:`APIError` (400) naming where a string is not Unicode text. Raised
    from a validator, it is not a ``ValueError``: pydantic lets it through to the 400 handler."""
    path = lone_surrogate_path(data)
    if path is not None:
        raise APIError(f"{path}: a string holds a lone surrogate (not valid Unicode text)", param=path)
    return data


def text_part(
    part: Any, at: str, kinds: str = "text only", shape: str = '{"type": "text", "text": ...}'
) -> str:
    """A chat content part ``{"type": "text", "text": str}``'s text, or :class:`APIError` naming
    the field at ``at`` (``kinds``: the part types the caller supports, for the message)."""
    if not isinstance(part, dict):
        raise APIError(f"{at} must be an object {shape}", param=at)
    if part.get("type") != "text":
        raise APIError(
            f"content part of type {part.get('type')!r} is not supported ({kinds})", param=f"{at}.type"
        )
    for key in part:
        if key not in ("type", "text"):
            raise APIError(f"{at}.{key} is not a field of a text part", param=f"{at}.{key}")
    if not isinstance(part.get("text"), str):
        raise APIError(f"{at}.text must be a string", param=f"{at}.text")
    return part["text"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown key is a 400

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions. Strict: a field of the wrong JSON type
    (a float or a bool for an integer, a string for a number, ...) is a 400 naming it."""

    model_config = _STRICT

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    # sent by clients by default, accepted and ignored (as vLLM does)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return refuse_lone_surrogates(data)

    def num_logprobs(self) -> int | None:
        """How many top log-probabilities each generated token reports (None: no logprobs)."""
        return None

    def check_fields(self) -> None:
        """Raise :class:`APIError` (400) naming a field this server does not implement."""
        for name in self.model_extra or {}:
            raise APIError(f"{name} is not supported by this server", param=name)
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(f"best_of={self.best_of} is not supported (only best_of == n)", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise APIError('response_format: only {"type": "text"} is supported', param="response_format")
        for key in self.logit_bias or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise APIError(
                    f"logit_bias keys must be token ids written in ASCII digits, got {key!r}",
                    param="logit_bias",
                )

    def sampling_params(self, max_tokens: int, prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; raises :class:`APIError` (400) naming the bad field."""
        self.check_fields()
        k = self.num_logprobs()
        kw: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "logprobs": k,
        }
        for name in _PASSED:
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if prompt_logprobs is not None:
            kw["prompt_logprobs"] = max(prompt_logprobs, kw.get("prompt_logprobs") or 0)
        if self.logit_bias:
            kw["logit_bias"] = {int(t): b for t, b in self.logit_bias.items()}
        try:
            return SamplingParams(**kw)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param=param_of(str(e))) from None


# fields handed to SamplingParams under their own names when a request sets them
_PASSED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
)


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
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Any = None  # checked by text(): a string, text parts or null
    name: str | None = None  # accepted and ignored (as the OpenAI API allows it)

    def check_fields(self, i: int) -> None:
        """Raise :class:`APIError` for a field of message ``i`` this server does not implement
        (``tool_calls``, ...); null values, as clients echo them back, are fine."""
        for name, value in (self.model_extra or {}).items():
            if value not in (None, [], ""):
                raise APIError(
                    f"messages[{i}].{name} is not supported by this server", param=f"messages.{i}.{name}"
                )

    def text(self, i: int = 0) -> str:
        """The content of message ``i`` as one string (``{"type": "text", "text": ...}`` parts
        joined). Only an assistant message may leave it out (as in the OpenAI API). Raises
        ``APIError`` naming the field for anything else: a part that is not a text part, a
        ``text`` that is not a string, a key a text part does not have."""
        where = f"messages.{i}.content"
        if self.content is None:
            if self.role != "assistant":
                raise APIError(f"a {self.role} message needs 'content'", param=where)
            return ""
        if isinstance(self.content, str):
            return self.content
        if not isinstance(self.content, list):
            raise APIError(f"{where} must be a string, a list of text parts or null", param=where)
        parts = []
        for j, part in enumerate(self.content):
            parts.append(text_part(part, f"{where}.{j}"))
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
            raise APIError(
                "Cannot set both continue_final_message and add_generation_prompt to "
                "true (continue the last message, or open a new one)",
                param="continue_final_message",
            )

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize`` body: ``prompt`` or ``messages`` (strict types, no other field)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return refuse_lone_surrogates(data)


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize`` body: ``tokens`` (JSON integers)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]
