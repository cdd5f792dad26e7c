"""Images to patches for Qwen2.5-VL, with Pillow and torch (Hugging Face's
``Qwen2VLImageProcessor`` reproduced; no ``transformers`` at run time).

1. Decode (:func:`load_image`): a PIL image, a path, or the file's bytes. The size is read from
   the header first and an image of more than ``max_image_pixels`` is refused before any pixel
   is decoded (a decompression bomb: a few KiB of PNG can claim gigapixels); a file that is not
   an image, or is cut short, is refused by name.
2. Resize (:func:`smart_resize`): each side to a multiple of 28 (one image token's square), the
   area kept within ``[min_pixels, max_pixels]`` and the aspect ratio as close as the rounding
   allows; bicubic, as Hugging Face's processor.
3. Normalise (CLIP's mean and std) and cut into 14x14 patches, each repeated twice in time
   (temporal patch 2), the 2x2 patches of one image token consecutive (:func:`patchify`).

An image of ``H x W`` pixels after resizing gives ``(H/14)*(W/14)`` patches and
``(H/28)*(W/28)`` image tokens: the tokens grow with the pixels, so ``max_pixels`` caps them.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56  # Hugging Face's defaults (Qwen2.5-VL's preprocessor_config)
MAX_PIXELS = 28 * 28 * 1280
MAX_IMAGE_PIXELS = 89_478_485  # Pillow's Image.MAX_IMAGE_PIXELS: refuse bigger files


class ImageError(ValueError):
    """An image that cannot be used; the message names the problem (a 400 for a server)."""


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> tuple[int, int]:
    """``(height, width)`` after resizing: multiples of ``factor``, area in ``[min_pixels,
    max_pixels]`` (rounded to the nearest multiple, then scaled down or up by
    ``sqrt(area ratio)`` with floor/ceil when outside). Raises :class:`ImageError` for an aspect
    ratio over 200 or an empty image."""
    if min(height, width) < 1:
        raise ImageError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def load_image(src: Any, max_image_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """A decoded RGB ``PIL.Image`` from a PIL image, a path (``str``/``Path``) or bytes.

    Raises :class:`ImageError` (a ``ValueError``) naming the problem: not an image, truncated,
    more than ``max_image_pixels`` pixels (checked from the header, before decoding), a missing
    file."""
    from PIL import Image

    if isinstance(src, Image.Image):
        img = src
        _check_pixels(img.size, max_image_pixels)
    else:
        if isinstance(src, (bytes, bytearray, memoryview)):
            fp: Any = io.BytesIO(bytes(src))
            what = "image bytes"
        elif isinstance(src, (str, Path)):
            if not Path(src).is_file():
                raise ImageError(f"image file {str(src)!r} does not exist")
            fp, what = open(src, "rb"), f"image file {Path(src).name!r}"  # noqa: SIM115
        else:
            raise ImageError(f"an image must be a PIL image, a path or bytes, not {type(src).__name__}")
        with fp:
            try:
                img = Image.open(fp)
            except Image.DecompressionBombError as e:
                raise ImageError(f"{what}: decompression bomb refused ({e})") from None
            except Exception:  # noqa: BLE001  (UnidentifiedImageError and kin)
                raise ImageError(f"{what}: not an image Pillow can decode") from None
            _check_pixels(img.size, max_image_pixels)
            try:
                img.load()
            except Exception as e:  # noqa: BLE001  (truncated or corrupt data)
                raise ImageError(f"{what}: truncated or corrupt image data ({type(e).__name__})") from None
    return img if img.mode == "RGB" else img.convert("RGB")


def _check_pixels(size: tuple[int, int], limit: int) -> None:
    w, h = size
    if w * h > limit:
        raise ImageError(
            f"image of {w}x{h} = {w * h} pixels is over the limit of {limit} pixels "
            f"(decompression-bomb guard, max_image_pixels)"
        )


def patchify(pixels: torch.Tensor, patch: int = 14, merge: int = 2, temporal: int = 2) -> torch.Tensor:
    """``pixels [C, H, W]`` -> ``[(H/patch)*(W/patch), C*temporal*patch*patch]``: patches in
    merge-unit-major order (the ``merge x merge`` patches of one token consecutive), each
    repeated ``temporal`` times (a still image as a 2-frame clip)."""
    C, H, W = pixels.shape
    gh, gw = H // patch, W // patch
    x = pixels.reshape(C, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # gh', gw', mh, mw, C, ph, pw
    x = x[:, :, :, :, :, None].expand(*x.shape[:5], temporal, patch, patch)
    return x.reshape(gh * gw, C * temporal * patch * patch)


@dataclass
class ProcessedImage:
    """One image ready for the vision tower: ``pixel_values [P, patch_dim]`` fp32, its patch grid
    ``(t, h, w)``, its ``num_tokens`` (``t*h*w / merge^2``) and ``content_hash`` (sha256 of the
    patches: equal images give equal hashes, for prefix caching)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    content_hash: str
    size: tuple[int, int]  # the resized (width, height), pixels


def process_image(
    img: Any,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    patch: int = 14,
    merge: int = 2,
    temporal: int = 2,
) -> ProcessedImage:
    """Resize (:func:`smart_resize`, bicubic), normalise and :func:`patchify` a decoded RGB
    ``PIL.Image``. Raises :class:`ImageError` for bad pixel bounds."""
    from PIL import Image

    if not 0 < min_pixels <= max_pixels:
        raise ImageError(
            f"min_pixels={min_pixels} and max_pixels={max_pixels} must satisfy 0 < min_pixels <= max_pixels"
        )
    factor = patch * merge
    if max_pixels < factor * factor:
        raise ImageError(f"max_pixels={max_pixels} is below one image token ({factor}x{factor} pixels)")
    w, h = img.size
    rh, rw = smart_resize(h, w, factor, min_pixels, max_pixels)
    if (rw, rh) != (w, h):
        img = img.resize((rw, rh), resample=Image.Resampling.BICUBIC)
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).reshape(rh, rw, 3)
    x = x.permute(2, 0, 1).float() / 255.0
    x = (x - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]
    pv = patchify(x, patch, merge, temporal)
    digest = hashlib.sha256(pv.numpy().tobytes()).hexdigest()
    grid = (1, rh // patch, rw // patch)
    return ProcessedImage(pv, grid, grid[1] * grid[2] // (merge * merge), digest, (rw, rh))
