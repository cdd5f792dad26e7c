"""``POST /v1/completions``: each prompt (text or token ids) is its own engine request.

Before any tokenizing: the number of prompts (``max_prompts_per_request``) and each text's
length (a text of more UTF-8 bytes than ``2 * max_model_len * max_token_bytes`` cannot fit the
context whatever its tokens) are checked; tokenizing runs on the tokenizer thread. ``echo`` puts
the prompt before each choice's text and, with ``logprobs``, the prompt tokens' log-probabilities
before the generated ones (vLLM's ``prompt_logprobs``; the first prompt token has none).
"""

from __future__ import annotations

from fastapi import Request

from llmlab.serve.context import ServingContext, get_context
from llmlab.serve.generation import Prompt, generate
from llmlab.serve.protocol import APIError, CompletionRequest


def check_text_size(ctx: ServingContext, text: str, param: str) -> None:
    """Raise :class:`APIError` for a text too long for the context, without tokenizing it."""
    limit = 2 * ctx.max_model_len * ctx.max_token_bytes
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise APIError(
            f"{param}: {size} bytes of text cannot fit the context of "
            f"{ctx.max_model_len} tokens (at most {limit} bytes are tokenized)",
            param=param,
        )


def _encode_all(ctx: ServingContext, prompts: list, echo: bool) -> list[tuple[str, list[int]]]:
    out = []
    for p in prompts:
        try:
            text, ids = ctx.engine.encode(p)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None
        if echo and text is None and ctx.tokenizer is not None:
            text = ctx.tokenizer.decode(ids)
        out.append((text if echo else "", ids))
    return out


async def completions(req: CompletionRequest, raw: Request):
    ctx = get_context(raw)
    ctx.check_model(req.model)
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    req.check_fields()
    if req.stream and req.prompt_logprobs is not None:
        raise APIError("prompt_logprobs is not available with stream", param="prompt_logprobs")
    prompts = req.prompts()
    limit = ctx.server.max_prompts_per_request
    if len(prompts) > limit:
        raise APIError(
            f"prompt: {len(prompts)} prompts are over the limit max_prompts_per_request={limit}",
            param="prompt",
        )
    for p in prompts:
        if isinstance(p, str):
            check_text_size(ctx, p, "prompt")
    encoded = await ctx.off_loop(_encode_all, ctx, prompts, req.echo)
    echo_lp = req.echo and req.logprobs is not None
    return await generate(
        ctx,
        raw,
        req,
        [
            Prompt(
                text,
                ids,
                req.sampling_params(
                    ctx.max_tokens_for(len(ids), req.max_tokens),
                    prompt_logprobs=req.logprobs if echo_lp else None,
                ),
            )
            for text, ids in encoded
        ],
        chat=False,
        echo_logprobs=echo_lp,
    )
