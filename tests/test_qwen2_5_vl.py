"""Qwen2.5-VL: the vision tower, M-RoPE and the processor against transformers, and images
through the engine (paged KV, chunked prefill, prefix caching, preemption) on a small random
checkpoint saved with transformers."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from llmlab.inference import LLM, SamplingParams
from llmlab.inference.image_processor import ImageError, load_image, process_image, smart_resize
from llmlab.model.mrope import mrope_positions

IMG, START, END = 255, 254, 253  # token ids of <|image_pad|>, <|vision_start|>, <|vision_end|>
MAX_PIXELS = 28 * 28 * 20
N_NEW = 6


def _images():
    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8))
        for shape in ((90, 130, 3), (200, 60, 3), (64, 64, 3))
    ]


def save_tiny_qwen2_5_vl(path):
    """A small random Qwen2.5-VL written by transformers to ``path``; returns the HF model.
    Byte vocabulary (256): the image tokens are bytes UTF-8 never produces."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            initializer_range=0.1,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=[1],
            initializer_range=0.1,
        ),
        image_token_id=IMG,
        video_token_id=252,
        vision_start_token_id=START,
        vision_end_token_id=END,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    return path, save_tiny_qwen2_5_vl(path)


CASES = [
    ([1, 2, 3, 4], []),  # no image
    ([1, 2, START, IMG, END, 5, 6], [0]),  # one image
    ([1, START, IMG, END, 9, START, IMG, END, 7], [0, 1]),
]  # two, other sizes/aspects


def _hf_processor():
    try:  # transformers 5: the PIL backend has its own class
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Processor,
        )
    except ImportError:  # transformers 4: the slow processor is the PIL one
        from transformers import Qwen2VLImageProcessor as Processor
    return Processor(min_pixels=56 * 56, max_pixels=MAX_PIXELS)


@pytest.fixture(scope="module")
def expected(ckpt):
    """transformers' greedy tokens for CASES."""
    _, hf = ckpt
    imgs, proc, out = _images(), _hf_processor(), []
    for ids, which in CASES:
        kw, x = {}, list(ids)
        if which:
            ref = proc([imgs[i] for i in which], return_tensors="pt")
            counts = iter((ref["image_grid_thw"].prod(-1) // 4).tolist())
            x = [t for tok in ids for t in ([IMG] * next(counts) if tok == IMG else [tok])]
            kw = dict(pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"])
        t = torch.tensor([x])
        with torch.no_grad():
            g = hf.generate(
                t, mm_token_type_ids=(t == IMG).int(), max_new_tokens=N_NEW, do_sample=False, **kw
            )
        out.append(g[0, len(x) :].tolist())
    return out


def _prompts(which_images=None):
    imgs = _images()
    return [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": [imgs[i] for i in w]}}
        if w
        else {"prompt_token_ids": ids}
        for ids, w in CASES
    ]


GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


def test_processor_matches_transformers():
    imgs = _images()
    ref = _hf_processor()(imgs, return_tensors="pt")
    mine = [process_image(im, 56 * 56, MAX_PIXELS) for im in imgs]
    assert torch.equal(ref["image_grid_thw"], torch.tensor([m.grid_thw for m in mine]))
    torch.testing.assert_close(
        torch.cat([m.pixel_values for m in mine]), ref["pixel_values"], atol=1e-5, rtol=0
    )
    # the token count follows the resize rule exactly, and halving max_pixels about halves it
    h, w = smart_resize(1080, 1920, 28, 56 * 56, 1_000_000)
    big = process_image(Image.new("RGB", (1920, 1080)), 56 * 56, 1_000_000)
    half = process_image(Image.new("RGB", (1920, 1080)), 56 * 56, 500_000)
    # 1920x1080 rounds to 1932x1092 > 1e6 pixels: beta = sqrt(1920*1080/1e6) = 1.44, so
    # floor(1080/1.44/28) = 26 and floor(1920/1.44/28) = 47 token rows and columns
    assert (h, w) == (26 * 28, 47 * 28) and big.num_tokens == 26 * 47
    assert 0.45 < half.num_tokens / big.num_tokens < 0.55
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 1_000_000


def test_mrope_positions_match_get_rope_index(ckpt):
    _, hf = ckpt
    grids = [(1, 6, 10), (1, 14, 4)]
    ids = [1, 2, START] + [IMG] * 15 + [END, 5, START] + [IMG] * 14 + [END, 7]
    x = torch.tensor([ids])
    pos, delta = hf.model.get_rope_index(x, (x == IMG).int(), torch.tensor(grids))
    mine, d = mrope_positions(len(ids), [(3, grids[0]), (21, grids[1])], 2)
    assert torch.equal(pos[:, 0], mine) and int(delta) == d == -17


def test_greedy_matches_transformers(ckpt, expected):
    path, _ = ckpt
    assert len({tuple(e) for e in expected}) == 3
    for kw in (
        dict(block_size=16),
        dict(block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=7, enable_prefix_caching=True),
    ):
        llm = LLM(str(path), max_pixels=MAX_PIXELS, check_invariants=True, **kw)
        outs = llm.generate(_prompts() * 2, GREEDY)  # a mixed text/image batch, twice
        assert [o.outputs[0].token_ids for o in outs] == expected * 2, kw
        n_img = [15, 14]  # tokens of images 0 and 1
        assert len(outs[1].prompt_token_ids) == 6 + n_img[0]
        assert len(outs[2].prompt_token_ids) == 7 + n_img[0] + n_img[1]


def test_images_change_the_output_and_every_source_works(ckpt, tmp_path):
    path, _ = ckpt
    llm = LLM(str(path), max_pixels=MAX_PIXELS)
    img = _images()[0]
    f = tmp_path / "a.png"
    img.save(f)
    ids = CASES[1][0]
    other = {"prompt_token_ids": ids, "multi_modal_data": {"image": _images()[2]}}
    outs = llm.generate(
        [
            {"prompt_token_ids": ids, "multi_modal_data": {"image": src}}
            for src in (img, str(f), f.read_bytes())
        ]
        + [other],
        GREEDY,
    )
    toks = [o.outputs[0].token_ids for o in outs]
    assert toks[0] == toks[1] == toks[2] != toks[3]


def test_chunked_prefill_encodes_each_image_once_and_survives_preemption(ckpt, expected):
    path, _ = ckpt
    llm = LLM(
        str(path),
        max_pixels=MAX_PIXELS,
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=5,
        num_gpu_blocks=12,
        check_invariants=True,
    )
    model = llm.engine.runner.model
    calls = []
    orig = model.encode_images
    model.encode_images = lambda pv, g: calls.append(g.tolist()) or orig(pv, g)
    out = llm.generate(_prompts()[2], GREEDY)[0]
    assert out.outputs[0].token_ids == expected[2]
    assert calls == [[[1, 6, 10]], [[1, 14, 4]]]  # once per image, split over steps
    calls.clear()
    outs = llm.generate(_prompts()[1:] * 2, GREEDY)  # too little cache: preemption
    assert [o.outputs[0].token_ids for o in outs] == expected[1:] * 2
    assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_prefix_cache_shares_the_same_image_never_a_different_one(ckpt, expected):
    path, _ = ckpt
    llm = LLM(str(path), max_pixels=MAX_PIXELS, block_size=4, enable_prefix_caching=True)
    p = _prompts()[1]
    first, second = (llm.generate(p, GREEDY)[0] for _ in range(2))
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected[1]
    assert first.metrics.num_prefix_cached_tokens == 0
    assert second.metrics.num_prefix_cached_tokens == 20  # 5 full blocks of 21 tokens
    other = dict(p, multi_modal_data={"image": _images()[2].resize((130, 90))})
    third = llm.generate(other, GREEDY)[0]
    assert len(third.prompt_token_ids) == len(first.prompt_token_ids)
    assert third.metrics.num_prefix_cached_tokens == 0  # the image starts in block 0
    fresh = LLM(str(path), max_pixels=MAX_PIXELS).generate(other, GREEDY)[0]
    assert third.outputs[0].token_ids == fresh.outputs[0].token_ids != first.outputs[0].token_ids


def _png_bytes(size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_images_are_refused_by_name(ckpt):
    path, _ = ckpt
    llm = LLM(str(path), max_pixels=MAX_PIXELS, limit_mm_per_prompt=2, max_image_pixels=10_000)
    ids = [1, START, IMG, END]

    def err(images, ids=ids):
        return llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY)[0].error

    assert "not an image" in err(b"hello, not a PNG")
    assert "truncated" in err(_png_bytes()[:60])
    assert "over the limit of 10000 pixels" in err(_png_bytes((1000, 1000)))
    assert "limit_mm_per_prompt=2" in err([_png_bytes()] * 3, ids * 3)
    assert "2 image placeholders" in err([_png_bytes()], ids * 2)
    ok = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": _png_bytes()}}, GREEDY)
    assert ok[0].error is None and len(ok[0].outputs[0].token_ids) == N_NEW
    assert llm.engine.block_manager.num_used_blocks == 0
    with pytest.raises(ImageError, match="does not exist"):
        load_image("/nonexistent/x.png")


def test_text_only_model_refuses_images():
    from llmlab.model.config import get_preset

    llm = LLM(get_preset("tiny"))
    out = llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": _png_bytes()}}, GREEDY)[0]
    assert "text-only" in out.error


def test_qwen2_vl_checkpoint_matches_transformers(tmp_path):
    """Qwen2-VL (LayerNorm, QuickGELU, no windows) loads into the same model."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            initializer_range=0.1,
        ),
        vision_config=dict(
            depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, initializer_range=0.1
        ),
        image_token_id=IMG,
        video_token_id=252,
        vision_start_token_id=START,
        vision_end_token_id=END,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    ids, which = CASES[2]
    imgs = [_images()[i] for i in which]
    ref = _hf_processor()(imgs, return_tensors="pt")
    counts = iter((ref["image_grid_thw"].prod(-1) // 4).tolist())
    x = torch.tensor([[t for tok in ids for t in ([IMG] * next(counts) if tok == IMG else [tok])]])
    with torch.no_grad():
        want = hf.generate(
            x,
            pixel_values=ref["pixel_values"],
            image_grid_thw=ref["image_grid_thw"],
            mm_token_type_ids=(x == IMG).int(),
            max_new_tokens=N_NEW,
            do_sample=False,
        )[0, x.shape[1] :].tolist()
    out = LLM(
        str(tmp_path),
        max_pixels=MAX_PIXELS,
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=9,
    ).generate({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}, GREEDY)[0]
    assert out.outputs[0].token_ids == want
