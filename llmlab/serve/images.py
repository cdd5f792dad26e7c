"""Images in chat requests: OpenAI ``image_url`` content parts for a vision-language model.

``{"type": "image_url", "image_url": {"url": ...}}`` with

- a ``data:`` URL (``data:image/png;base64,...``): the image travels in the request body;
- a ``file://`` URL under ``--allowed-local-media-path DIR`` (vLLM's flag): the server reads the
  file itself, so a client on shared storage sends a path instead of megabytes of base64. The
  path is resolved (``realpath``: ``..`` and symlinks followed) and must stay inside ``DIR``;
- ``http(s)://`` URLs are refused: this server fetches nothing from the network.

Each image becomes ``<|vision_start|><|image_pad|><|vision_end|>`` at its place in the message
(the chat template renders the text around it), is decoded and resized on the tokenizer thread
(:mod:`llmlab.inference.image_processor`: ``--max-pixels``/``--min-pixels``, per request
``mm_processor_kwargs``; the decompression-bomb guard ``--max-image-pixels``), and its
placeholder is expanded to its image tokens before the request is admitted, so the usage's
``prompt_tokens`` counts them. Every problem is a 400 naming it; nothing of the request is left
in the engine.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
import urllib.parse
from typing import Any

from llmlab.inference import multimodal
from llmlab.inference.image_processor import ImageError, load_image, process_image
from llmlab.serve.protocol import APIError, text_part


def has_images(messages: list) -> bool:
    """Whether any message holds an ``image_url`` content part."""
    return any(
        isinstance(m.content, list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m.content)
        for m in messages
    )


def _image_url(part: dict, at: str) -> str:
    for key in part:
        if key not in ("type", "image_url"):
            raise APIError(f"{at}.{key} is not a field of an image_url part", param=f"{at}.{key}")
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else None
    if not isinstance(url, str) or not url:
        raise APIError(
            f"{at}.image_url.url must be a string (a data: or file:// URL)", param=f"{at}.image_url.url"
        )
    assert isinstance(spec, dict)
    for key in spec:
        if key not in ("url", "detail"):
            raise APIError(f"{at}.image_url.{key} is not supported", param=f"{at}.image_url.{key}")
    return url


def split_parts(messages: list, tag: str) -> tuple[list[dict], list[str]]:
    """``[{"role", "content"}]`` with each image part written as ``tag + index + "E"``, and the
    images' URLs in order. Raises :class:`APIError` naming the part for anything but text and
    image_url parts of the OpenAI shape."""
    out: list[dict[str, Any]] = []
    urls: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            out.append({"role": m.role, "content": m.text(i)})
            continue
        text = []
        for j, part in enumerate(m.content):
            at = f"messages.{i}.content.{j}"
            if isinstance(part, dict) and part.get("type") == "image_url":
                text.append(f"{tag}{len(urls)}E")
                urls.append(_image_url(part, at))
            else:
                text.append(text_part(part, at, "text, image_url", "(a text or image_url part)"))
        out.append({"role": m.role, "content": "".join(text)})
    return out, urls


def _data_url(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise APIError("image_url: a data: URL must be base64 (data:image/...;base64,...)", param="messages")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError("image_url: the data: URL is not valid base64", param="messages") from None


def _file_url(url: str, allowed: str | None) -> str:
    if not allowed:
        raise APIError(
            "image_url: file:// URLs are refused; start the server with "
            "--allowed-local-media-path DIR to read images under DIR",
            param="messages",
        )
    u = urllib.parse.urlparse(url)
    if u.netloc not in ("", "localhost"):
        raise APIError("image_url: a file:// URL must name a local path (file:///...)", param="messages")
    root = os.path.realpath(allowed)
    path = os.path.realpath(urllib.parse.unquote(u.path))
    if os.path.commonpath([root, path]) != root:
        raise APIError("image_url: the file is outside --allowed-local-media-path", param="messages")
    return path


def fetch(url: str, allowed: str | None) -> bytes | str:
    """The image's bytes (``data:``) or its checked path (``file://``); raises :class:`APIError`
    for http(s) and other schemes."""
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url(url)
    if scheme == "file":
        return _file_url(url, allowed)
    if scheme in ("http", "https"):
        raise APIError(
            "image_url: http(s) URLs are not fetched by this server; send the image as "
            "a data: URL (base64) or a file:// URL under --allowed-local-media-path",
            param="messages",
        )
    raise APIError(f"image_url: unsupported URL scheme {scheme!r} (data:, file://)", param="messages")


def pixel_bounds(cfg: Any, kwargs: dict | None) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of a request: the engine's, or ``mm_processor_kwargs``'
    within them. Raises :class:`APIError` for unknown keys or a cap above the server's."""
    kw = dict(kwargs or {})
    bad = set(kw) - {"min_pixels", "max_pixels"}
    if bad:
        raise APIError(
            f"mm_processor_kwargs: unknown keys {sorted(bad)} (min_pixels, max_pixels)",
            param="mm_processor_kwargs",
        )
    try:
        hi = int(kw.get("max_pixels", cfg.max_pixels))
        lo = int(kw.get("min_pixels", min(cfg.min_pixels, hi)))
    except (TypeError, ValueError):
        raise APIError(
            "mm_processor_kwargs: min_pixels and max_pixels must be integers", param="mm_processor_kwargs"
        ) from None
    if hi > cfg.max_pixels:
        raise APIError(
            f"mm_processor_kwargs: max_pixels={hi} is over the server's --max-pixels {cfg.max_pixels}",
            param="mm_processor_kwargs",
        )
    return lo, hi


def render(
    ctx: Any,
    messages: list,
    req_kwargs: dict | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> tuple[list[int], Any]:
    """Token ids (image placeholders expanded) and the engine's multimodal state of a chat
    request with image parts; runs on the tokenizer thread. Raises :class:`APIError`."""
    engine, cfg = ctx.engine, ctx.config
    mm = getattr(engine, "mm_config", None)
    if mm is None:
        raise APIError(
            "this model is text-only: image_url parts need a vision-language model", param="messages"
        )
    tag = f"LLMLABIMAGE{secrets.token_hex(8)}N"
    plain, urls = split_parts(messages, tag)
    if len(urls) > cfg.limit_mm_per_prompt:
        raise APIError(
            f"{len(urls)} images in one request are over --limit-mm-per-prompt {cfg.limit_mm_per_prompt}",
            param="messages",
        )
    r = ctx.renderer
    if any(t in m["content"] for m in plain for t in r.special_tokens):
        raise APIError("a message with images may not hold special-token text", param="messages")
    lo, hi = pixel_bounds(cfg, req_kwargs)
    v = mm.vision
    images = []
    for url in urls:
        try:
            img = load_image(fetch(url, ctx.server.allowed_local_media_path), cfg.max_image_pixels)
            images.append(
                process_image(img, lo, hi, v.patch_size, v.spatial_merge_size, v.temporal_patch_size)
            )
        except ImageError as e:
            raise APIError(f"image_url: {e}", param="messages") from None
    text, _ = r.render(plain, add_generation_prompt, continue_final_message)
    parts = re.split(f"{tag}(\\d+)E", text)
    ids: list[int] = []
    slot = [mm.vision_start_token_id, mm.image_token_id, mm.vision_end_token_id]
    for k, piece in enumerate(parts):
        ids += (r.encode(piece) if piece else []) if k % 2 == 0 else slot
    try:
        return multimodal.prepare(ids, images, mm, limit=cfg.limit_mm_per_prompt)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
