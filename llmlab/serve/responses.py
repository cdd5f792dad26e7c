"""Engine outputs to OpenAI response bodies: whole responses, and streamed chunks.

Streaming follows the OpenAI API (and vLLM): server-sent events ``data: {chunk}\\n\\n`` ending
with ``data: [DONE]``; each chunk carries one choice with its ``index`` (``prompt * n + sample``)
and the text added since that choice's previous chunk; ``finish_reason`` is null except on a
choice's last chunk; with ``stream_options.include_usage`` every chunk has ``"usage": null`` and
one last chunk with no choices carries the request's ``usage``. The chat stream opens each choice
with a ``{"role": "assistant", "content": ""}`` delta.

Text deltas: the engine gives each choice's whole visible text so far; a delta is what follows the
text already sent. A trailing U+FFFD (an incomplete UTF-8 character of a byte-level model, or an
incomplete multi-byte token) is held back until the next token completes it or the choice ends,
so the streamed pieces concatenate to exactly the non-streamed text.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj) -> str:
    """One server-sent event."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class ChoiceDeltas:
    """Per choice: the text already streamed and whether its last chunk was sent."""

    def __init__(self) -> None:
        self.sent: dict[int, str] = {}
        self.done: set[int] = set()

    def delta(self, index: int, text: str | None, finish_reason: str | None):
        """``(delta text, finish_reason or None)``, or None when there is nothing to send."""
        if index in self.done:
            return None
        text = text or ""
        prev = self.sent.get(index, "")
        if finish_reason is None:
            text = text.rstrip("\ufffd")
        if not text.startswith(prev):  # cannot happen with the engine's text; be safe
            text = prev
        piece = text[len(prev) :]
        if not piece and finish_reason is None:
            return None
        self.sent[index] = text
        if finish_reason is not None:
            self.done.add(index)
        return piece, finish_reason


def _token_text(lp, token_id: int, decode) -> str:
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else decode([token_id])


class LogprobCursor:
    """One choice's generated tokens whose logprobs were sent, and where the next one's text
    starts in the choice's text. Only tokens that start inside the text sent so far are
    reported, so the reported tokens join back into the text: the end-of-turn token and a token
    that hit a stop string (left out of the text) are never reported, and every ``text_offset``
    lies within the text (vLLM's behaviour). Each token is looked at once."""

    def __init__(self, start: int = 0):
        self.count, self.at = 0, start

    def advance(self, token_ids: list[int], logprobs: list, decode, end: int) -> tuple[int, int, int]:
        """``(first, stop, offset)``: tokens ``[first, stop)`` are newly inside the text of
        length ``end``; the first of them starts at ``offset``."""
        first, offset = self.count, self.at
        while self.count < min(len(token_ids), len(logprobs)) and self.at < end:
            tid = token_ids[self.count]
            self.at += len(_token_text(logprobs[self.count].get(tid), tid, decode))
            self.count += 1
        return first, self.count, offset


def completion_logprobs(token_ids: list[int], logprobs: list[dict], decode, text_offset: int = 0) -> dict:
    """The completions API's ``logprobs`` of generated tokens: ``tokens`` (their text),
    ``token_logprobs``, ``top_logprobs`` (``{text: logprob}`` of the top K and the sampled
    token) and ``text_offset`` (where each token's text starts in the choice's text).
    ``logprobs[i]``: the engine's ``{token_id: Logprob}`` of token ``i`` (None: the first prompt
    token, which has no log-probability: ``null`` entries as vLLM's echo)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, d in zip(token_ids, logprobs):
        if d is None:
            text = decode([tid])
            for key, v in (
                ("tokens", text),
                ("token_logprobs", None),
                ("top_logprobs", None),
                ("text_offset", text_offset),
            ):
                out[key].append(v)
            text_offset += len(text)
            continue
        text = _token_text(d.get(tid), tid, decode)
        out["tokens"].append(text)
        out["token_logprobs"].append(d[tid].logprob if tid in d else None)
        out["top_logprobs"].append(
            {_token_text(lp, t, decode): lp.logprob for t, lp in sorted(d.items(), key=lambda x: x[1].rank)}
        )
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def vllm_prompt_logprobs(prompt_logprobs: list) -> list:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}``."""
    return [
        None
        if d is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in d.items()
        }
        for d in prompt_logprobs
    ]


def join_completion_logprobs(first: dict, then: dict | None) -> dict:
    """Two completions ``logprobs`` objects one after the other (echoed prompt, then output)."""
    if then is None:
        return first
    return {k: first[k] + then[k] for k in first}


def chat_logprobs(token_ids: list[int], logprobs: list[dict], decode, top: int) -> dict:
    """The chat API's ``logprobs``: ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}] (the ``top`` most likely)}]}``."""

    def entry(t, lp):
        text = _token_text(lp, t, decode)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for tid, d in zip(token_ids, logprobs):
        ranked = sorted(d.items(), key=lambda x: x[1].rank)
        e = entry(tid, d[tid]) if tid in d else {"token": decode([tid]), "logprob": None, "bytes": None}
        e["top_logprobs"] = [entry(t, lp) for t, lp in ranked[:top]]
        content.append(e)
    return {"content": content}


def completion_response(
    request_id: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int, chat: bool
) -> dict:
    """A whole response. ``choices``: ``{"index", "text", "finish_reason"}`` (and ``"logprobs"``)
    in index order."""
    if chat:
        body = [
            {
                "index": c["index"],
                "message": {"role": "assistant", "content": c["text"]},
                "logprobs": c.get("logprobs"),
                "finish_reason": c["finish_reason"],
            }
            for c in choices
        ]
    else:
        body = [
            {
                "index": c["index"],
                "text": c["text"],
                "logprobs": c.get("logprobs"),
                "finish_reason": c["finish_reason"],
            }
            | ({"prompt_logprobs": c["prompt_logprobs"]} if "prompt_logprobs" in c else {})
            for c in choices
        ]
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": body,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    text: str | None,
    finish_reason: str | None,
    chat: bool,
    include_usage: bool,
    role: bool = False,
    logprobs: dict | None = None,
) -> dict:
    """One streamed chunk for one choice. ``role``: the chat stream's opening delta;
    ``logprobs``: those of the tokens new since the choice's previous chunk."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    out: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(
    request_id: str, model: str, created: int, prompt_tokens: int, completion_tokens: int, chat: bool
) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }
