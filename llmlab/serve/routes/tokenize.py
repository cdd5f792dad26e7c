"""vLLM's ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize``: ``{"prompt": text}`` (``add_special_tokens``, default true: as a completion's
prompt is tokenized) or ``{"messages": [...]}`` (rendered by the chat template, as a chat
request; ``add_generation_prompt``, ``continue_final_message``) -> ``{"count", "max_model_len",
"tokens"}`` (and ``"token_strs"`` with ``return_token_strs``). ``/detokenize``: ``{"tokens":
[ids]}`` -> ``{"prompt": text}``; an id outside the vocabulary is a 400.
"""

from __future__ import annotations

from fastapi import Request

from llmlab.serve.context import ServingContext, get_context
from llmlab.serve.protocol import APIError, DetokenizeRequest, TokenizeRequest
from llmlab.serve.routes.completions import check_text_size


def _encode_text(ctx: ServingContext, text: str, add_special_tokens: bool) -> list[int]:
    tok = ctx.tokenizer
    if add_special_tokens or not hasattr(tok, "apply_chat_template"):  # the byte tokenizer
        return ctx.engine.encode(text)[1]
    return list(tok.encode(text, add_special_tokens=False))


async def tokenize(req: TokenizeRequest, raw: Request):
    ctx = get_context(raw)
    ctx.check_model(req.model)
    if ctx.tokenizer is None:
        raise APIError("this model has no tokenizer")
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        check_text_size(ctx, req.prompt, "prompt")
        ids = await ctx.off_loop(_encode_text, ctx, req.prompt, req.add_special_tokens)
    else:
        if ctx.renderer is None:
            raise APIError("this model has no chat template renderer", param="messages")
        given = req.messages or []
        for i, m in enumerate(given):
            m.check_fields(i)
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(given)]
        check_text_size(ctx, "".join(m["content"] for m in messages), "messages")
        try:
            _, ids = await ctx.off_loop(
                ctx.renderer.render, messages, req.add_generation_prompt, req.continue_final_message
            )
        except Exception as e:  # a template error is the request's fault
            raise APIError(f"chat template failed: {e}", param="messages") from None
    body = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [ctx.decode([t]) for t in ids]
    return body


async def detokenize(req: DetokenizeRequest, raw: Request):
    ctx = get_context(raw)
    ctx.check_model(req.model)
    if ctx.tokenizer is None:
        raise APIError("this model has no tokenizer")
    V = ctx.engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < V]
    if bad:
        raise APIError(f"tokens: ids {bad[:8]} are outside the vocabulary [0, {V})", param="tokens")
    return {"prompt": await ctx.off_loop(ctx.decode, req.tokens)}
