"""Image decoding: encoded bytes -> uint8 [3, S, S], the only per-sample image work.

Normalization is not done here: it is one float op per batch where the batch lands
(``Batch.pixels``), so workers move 4x fewer bytes and do no float math. The output is a
numpy array (the dataset wraps it without a copy) so that ``vltrain data validate`` and
``stats`` do not pay for importing torch.
"""

from __future__ import annotations

import io
import math
import struct
import zlib

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

WHITE = (255, 255, 255, 255)
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
REDUCING_GAP = 2.0
"""Resize first by an integer box reduction down to 2x the target, then resample (fast and
visually equivalent to a full bicubic at the sizes we train on)."""

# What Pillow raises on broken input. A bug in our code (TypeError, ...) is not caught.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error, zlib.error)


class ImageError(ValueError):
    """An image that cannot be used; the message is the reason shown to the user."""


def decode_image(
    data: bytes, size: int, resize: str = "crop", max_pixels: int = 89_478_485
) -> np.ndarray:
    """Decode, orient, convert to RGB, resize to ``size`` x ``size``; uint8 CHW."""
    try:
        im = open_image(data, max_pixels)
        if im.format == "JPEG":
            # Let libjpeg decode at 1/2, 1/4 or 1/8 scale when the image is much larger than needed.
            im.draft(None, _draft_size(im.size, size, resize))
        im = _oriented(im)
        im = to_rgb(im)
        im = resize_image(im, size, resize)
        arr = np.asarray(im)
    except Image.DecompressionBombError as e:
        raise ImageError(f"decompression bomb refused by Pillow: {e}") from e
    except ImageError:
        raise
    except DECODE_ERRORS as e:
        raise ImageError(f"cannot decode image: {e}") from e
    return arr.transpose(2, 0, 1).copy()


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Open (header only) and refuse empty files, non-images and decompression bombs."""
    if not data:
        raise ImageError("empty file (0 bytes)")
    try:
        im = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as e:
        raise ImageError("not an image Pillow can read (wrong extension or corrupt header)") from e
    w, h = im.size
    if w * h > max_pixels:
        raise ImageError(
            f"{w}x{h} = {w * h} pixels exceeds data.max_image_pixels ({max_pixels}): "
            "refused as a possible decompression bomb"
        )
    if w < 1 or h < 1:
        raise ImageError(f"image has no pixels ({w}x{h})")
    return im


def _draft_size(wh: tuple[int, int], size: int, resize: str) -> tuple[int, int]:
    """The smallest decode size that still covers the output without upsampling."""
    w, h = wh
    if resize == "squash":
        return (min(w, size), min(h, size))
    s = size / min(w, h)
    return (min(w, math.ceil(w * s)), min(h, math.ceil(h * s)))


def _oriented(im: Image.Image) -> Image.Image:
    orientation = im.getexif().get(ExifTags.Base.Orientation, 1)
    return ImageOps.exif_transpose(im) if orientation in range(2, 9) else im


def to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB; transparent pixels become white, 16-bit grey keeps its range."""
    if im.mode == "RGB":
        return im
    if im.mode in SIXTEEN_BIT_MODES or im.mode == "I":
        a = np.asarray(im).astype(np.int64)
        grey = np.clip(a, 0, 65535) >> 8
        return Image.fromarray(grey.astype(np.uint8), "L").convert("RGB")
    if im.mode in ALPHA_MODES or "transparency" in im.info:
        rgba = im.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, WHITE)
        canvas.alpha_composite(rgba)
        return canvas.convert("RGB")
    return im.convert("RGB")


def resize_image(im: Image.Image, size: int, resize: str = "crop") -> Image.Image:
    """Shorter side to ``size`` then center crop ("crop"), or both sides to ``size`` ("squash").

    The crop is passed to Pillow as the resize's source box, so only the kept region is resampled.
    """
    w, h = im.size
    if resize == "squash":
        box = (0.0, 0.0, float(w), float(h))
    else:
        side = min(w, h)
        left, top = (w - side) / 2, (h - side) / 2
        box = (left, top, left + side, top + side)
    if (w, h) == (size, size) and box == (0.0, 0.0, float(w), float(h)):
        return im
    return im.resize((size, size), Image.Resampling.BICUBIC, box=box, reducing_gap=REDUCING_GAP)
