"""Images through the OpenAI server: image_url parts as data: (base64) and file:// URLs give
the engine's greedy text (which equals transformers', tests/test_qwen2_5_vl.py), usage counts
the image tokens, max_pixels caps them, and every bad image is a 400 naming the problem with
nothing left behind."""

from __future__ import annotations

import base64
import io
import os

import pytest
from PIL import Image

from llmlab.inference import LLM, SamplingParams
from llmlab.serve import start_server
from test_openai_server import _post, _wait
from test_qwen2_5_vl import END, IMG, MAX_PIXELS, START, save_tiny_qwen2_5_vl


def _png(size=(130, 90), color=(200, 30, 90)) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", size, color)
    img.putpixel((5, 7), (0, 0, 0))
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_images")
    save_tiny_qwen2_5_vl(root / "model")
    media = root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(_png())
    (root / "secret.png").write_bytes(_png())
    os.symlink(root / "secret.png", media / "link.png")
    with start_server(
        str(root / "model"),
        served_model_name="vl",
        max_pixels=MAX_PIXELS,
        allowed_local_media_path=str(media),
        limit_mm_per_prompt=2,
        max_image_pixels=200_000,
        block_size=4,
        enable_prefix_caching=True,
        num_gpu_blocks=64,
    ) as s:
        yield s, root, media


def _chat(server, parts, **extra):
    body = {
        "model": "vl",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": parts}],
        **extra,
    }
    return _post(server.url + "/v1/chat/completions", body)


def _img(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _data(b: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(b).decode()


def _idle(server) -> bool:
    return all(
        not e.engine.has_unfinished_requests()
        and not e.engine.requests
        and e.engine.block_manager.num_used_blocks == 0
        for e in server.engines
    )


def test_base64_and_file_urls_give_the_engines_text(setup):
    server, root, media = setup
    text = {"type": "text", "text": "what is it?"}
    code, by_data = _chat(server, [_img(_data(_png())), text])
    assert code == 200, by_data
    code, by_path = _chat(server, [_img(f"file://{media}/a.png"), text])
    assert code == 200, by_path
    # the same prompt through LLM.generate: the plain template's "user: <image>what is it?\n"
    ids = list(b"user: ") + [START, IMG, END] + list(b"what is it?\nassistant:")
    llm = LLM(str(root / "model"), max_pixels=MAX_PIXELS)
    out = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": _png()}},
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )[0]
    want = out.outputs[0].text
    assert by_data["choices"][0]["message"]["content"] == want
    assert by_path["choices"][0]["message"]["content"] == want
    # usage counts the image's 15 tokens (a 130x90 image resizes to 140x84: 5x3 tokens)
    assert by_data["usage"]["prompt_tokens"] == len(ids) - 1 + 15 == len(out.prompt_token_ids)
    # the same image again shares the prompt's blocks
    assert server.engines[0].engine.block_manager.stats["prefix_hit_tokens"] > 0
    # halving max_pixels per request about halves the image tokens (and follows smart_resize)
    code, small = _chat(
        server, [_img(_data(_png((260, 180)))), text], mm_processor_kwargs={"max_pixels": MAX_PIXELS // 2}
    )
    code2, big = _chat(server, [_img(_data(_png((260, 180)))), text])
    n_small = small["usage"]["prompt_tokens"] - len(ids) + 1
    n_big = big["usage"]["prompt_tokens"] - len(ids) + 1
    # 260x180 over 15680 pixels: beta = sqrt(46800/15680) = 1.73 -> floor(104/28) = 3 rows,
    # floor(150/28) = 5 columns; over 7840: beta = 2.44 -> 2 rows, 3 columns
    assert (code, code2) == (200, 200) and (n_big, n_small) == (3 * 5, 2 * 3)


def test_bad_images_are_400_naming_the_problem(setup):
    server, root, media = setup
    _, before = _chat(server, [_img(_data(_png()))])
    cases = {
        "not an image": [_img(_data(b"hello, not a PNG"))],
        "truncated": [_img(_data(_png()[:80]))],
        "over the limit of 200000 pixels": [_img(_data(_png((1000, 1000))))],
        "outside --allowed-local-media-path": [_img(f"file://{media}/../secret.png")],
        "outside --allowed-local-media-path ": [_img(f"file://{media}/link.png")],
        "outside --allowed-local-media-path  ": [_img("file:///etc/hostname")],
        "over --limit-mm-per-prompt 2": [_img(_data(_png()))] * 3,
        "http(s) URLs are not fetched": [_img("https://example.com/cat.png")],
        "not valid base64": [_img("data:image/png;base64,@@@")],
    }
    for what, parts in cases.items():
        code, err = _chat(server, parts)
        assert code == 400 and what.strip() in err["error"]["message"], (what, err)
        assert str(root) not in err["error"]["message"]
    code, err = _chat(server, [_img(_data(_png()))], mm_processor_kwargs={"max_pixels": 10**9})
    assert code == 400 and "over the server's --max-pixels" in err["error"]["message"]
    _wait(lambda: _idle(server), "an idle engine")
    _, after = _chat(server, [_img(_data(_png()))])
    assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]


def test_text_only_model_refuses_image_parts():
    with start_server("shakespeare", num_gpu_blocks=32, block_size=8) as s:
        code, err = _post(
            s.url + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [_img(_data(_png()))]}], "max_tokens": 2},
        )
    assert code == 400 and "text-only" in err["error"]["message"]


def test_streamed_image_chat_equals_the_whole_answer(setup):
    import openai

    server, _, media = setup
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [
        {"role": "user", "content": [_img(f"file://{media}/a.png"), {"type": "text", "text": "and now?"}]}
    ]
    kw = dict(model="vl", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
