"""Images in: what the ``max_pixels`` cap buys, and what base64 costs against a path (issue 43).

1. Image tokens and time to first token against the cap, on a real photograph
   (matplotlib's ``grace_hopper.jpg``, 512x600) scaled to several sizes: the tokens follow
   ``smart_resize`` exactly, so they grow with the pixels until the cap, then stay at it; TTFT
   (engine prefill, plus decode/resize/patchify measured apart; the best of 3, the CPU being
   shared) follows the tokens.
2. The same photographs sent as a ``data:`` URL (base64 in the JSON body) or a ``file://`` URL:
   bytes on the wire and the server-side cost of parsing the body and getting the image's bytes
   (``json.loads`` + ``base64`` decode, against ``json.loads`` + ``realpath`` checks + a file
   read), then the decode both share.

The model is a small random Qwen2.5-VL (its vision tower and language model are llmlab's own), so
the times show the shape, not a real model's speed. Run: ``python benchmarks/bench_images.py``.
"""
from __future__ import annotations

import base64
import io
import json
import os
import tempfile
import time

import matplotlib
from PIL import Image

from llmlab.inference import LLM, SamplingParams
from llmlab.inference.image_processor import load_image, process_image
from llmlab.model.qwen2_5_vl import small_qwen2_5_vl
from llmlab.serve import images as serve_images

PHOTO = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data",
                     "grace_hopper.jpg")
SCALES = (1, 2, 4)                       # 512x600, 1024x1200, 2048x2400
CAPS = (128 * 28 * 28, 256 * 28 * 28, 512 * 28 * 28, 1024 * 28 * 28)


def photographs(tmp: str) -> list[str]:
    base = Image.open(PHOTO).convert("RGB")
    paths = []
    for s in SCALES:
        p = os.path.join(tmp, f"photo_x{s}.jpg")
        base.resize((base.width * s, base.height * s), Image.BICUBIC).save(p, quality=90)
        paths.append(p)
    return paths


def _best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def tokens_and_ttft(paths: list[str]) -> list[dict]:
    llm = LLM(small_qwen2_5_vl(), max_pixels=max(CAPS), max_model_len=8192,
              max_num_batched_tokens=8192)
    ids = [1, 254, 255, 253, 2]
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for path in paths:
        img = load_image(path)
        for cap in CAPS:
            pre = _best(lambda: process_image(load_image(path), max_pixels=cap), 3)
            ttft = []
            for _ in range(3):
                out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img},
                                    "mm_processor_kwargs": {"max_pixels": cap}}, sp)[0]
                ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
            rows.append({"image": f"{img.width}x{img.height}", "max_pixels": cap,
                         "image_tokens": len(out.prompt_token_ids) - len(ids) + 1,
                         "preprocess_ms": 1e3 * pre, "ttft_ms": 1e3 * min(ttft)})
    return rows


def base64_vs_path(paths: list[str], media: str) -> list[dict]:
    rows = []
    for path in paths:
        raw = open(path, "rb").read()

        def body(url: str) -> bytes:
            return json.dumps({"model": "vl", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}]}).encode()

        b64 = body("data:image/jpeg;base64," + base64.b64encode(raw).decode())
        ref = body("file://" + path)

        def get(b: bytes) -> bytes | str:
            return serve_images.fetch(json.loads(b)["messages"][0]["content"][0]["image_url"]["url"],
                                      media)

        def read(b: bytes) -> None:
            src = get(b)
            if isinstance(src, str):
                with open(src, "rb") as f:
                    f.read()

        rows.append({"image": f"{Image.open(path).size[0]}x{Image.open(path).size[1]}",
                     "file_bytes": len(raw), "body_base64": len(b64), "body_path": len(ref),
                     "parse_base64_ms": 1e3 * _best(lambda: get(b64)),
                     "parse_path_ms": 1e3 * _best(lambda: read(ref)),
                     "decode_ms": 1e3 * _best(lambda: load_image(io.BytesIO(raw).getvalue()), 3)})
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench_images_") as tmp:
        paths = photographs(tmp)
        print("image      max_pixels  image tokens  preprocess ms  TTFT ms")
        for r in tokens_and_ttft(paths):
            print(f"{r['image']:>10} {r['max_pixels']:>11} {r['image_tokens']:>13} "
                  f"{r['preprocess_ms']:>14.1f} {r['ttft_ms']:>8.1f}")
        print("\nimage      file bytes  body base64  body path  parse+fetch base64 ms  "
              "parse+read path ms  decode ms")
        for r in base64_vs_path(paths, tmp):
            print(f"{r['image']:>10} {r['file_bytes']:>11} {r['body_base64']:>12} "
                  f"{r['body_path']:>10} {r['parse_base64_ms']:>22.2f} "
                  f"{r['parse_path_ms']:>19.2f} {r['decode_ms']:>10.1f}")


if __name__ == "__main__":
    main()
