"""``POST /v1/chat/completions``: the messages rendered by the chat template
(:class:`~llmlab.serve.chat.ChatRenderer`: special tokens inside a content stay text;
``add_generation_prompt``, ``continue_final_message``) on the tokenizer thread, then one engine
request."""

from __future__ import annotations

from fastapi import Request

from llmlab.serve import images
from llmlab.serve.context import get_context
from llmlab.serve.generation import Prompt, generate
from llmlab.serve.protocol import APIError, ChatCompletionRequest
from llmlab.serve.routes.completions import check_text_size


async def chat_completions(req: ChatCompletionRequest, raw: Request):
    ctx = get_context(raw)
    ctx.check_model(req.model)
    if ctx.renderer is None:
        raise APIError("this model has no tokenizer: chat completions need one")
    mm_kwargs = (req.model_extra or {}).pop("mm_processor_kwargs", None)  # vLLM's, for images
    req.check_fields()
    if req.prompt_logprobs is not None:
        raise APIError("prompt_logprobs is not supported for chat completions", param="prompt_logprobs")
    if images.has_images(req.messages):  # image_url parts (llmlab.serve.images)
        ids, mm = await ctx.off_loop(
            images.render, ctx, req.messages, mm_kwargs, req.add_generation_prompt, req.continue_final_message
        )
        params = req.sampling_params(ctx.max_tokens_for(len(ids), req.requested_max_tokens()))
        return await generate(ctx, raw, req, [Prompt("", ids, params, mm)], chat=True)
    messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(req.messages)]
    check_text_size(ctx, "".join(m["content"] for m in messages), "messages")
    try:
        _, ids = await ctx.off_loop(
            ctx.renderer.render, messages, req.add_generation_prompt, req.continue_final_message
        )
    except APIError:
        raise
    except Exception as e:  # a template error is the request's fault
        raise APIError(f"chat template failed: {e}", param="messages") from None
    params = req.sampling_params(ctx.max_tokens_for(len(ids), req.requested_max_tokens()))
    return await generate(ctx, raw, req, [Prompt("", ids, params)], chat=True)
