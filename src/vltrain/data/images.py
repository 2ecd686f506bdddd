"""Image decoding: encoded bytes -> uint8 [3, S, S], the only per-sample image work.

Normalization is not done here: it is one float op per batch where the batch lands
(``Batch.pixels``), so workers move 4x fewer bytes and do no float math. The resize runs on
the uint8 pixels with torch's antialiased bicubic kernel, which matches Pillow's bicubic to
within 3 grey levels and is several times faster (benchmarks/data_pipeline.py).
"""

from __future__ import annotations

import io
import math
import struct
import warnings
import zlib

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

# decode_image wraps the read-only bytes of a decoded image and never writes to them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)

WHITE = (255, 255, 255, 255)
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")

# What Pillow raises on broken input. A bug in our code (TypeError, ...) is not caught.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error, zlib.error)


class ImageError(ValueError):
    """An image that cannot be used; the message is the reason shown to the user."""


def decode_image(
    data: bytes, size: int, resize: str = "crop", max_pixels: int = 89_478_485, draft_ratio: float = 1.0,
    interpolation: str = "bicubic",
) -> torch.Tensor:
    """Decode, orient, convert to RGB, resize to ``size`` x ``size``; uint8 CHW."""
    try:
        im = load_rgb(data, size, resize, max_pixels, draft_ratio)
        # Pillow's pixels are copied out once (tobytes) and wrapped, not copied again by numpy;
        # resize_pixels only reads them.
        hwc = torch.frombuffer(im.tobytes(), dtype=torch.uint8).view(im.height, im.width, 3)
    except ImageError:
        raise
    except DECODE_ERRORS as e:
        raise ImageError(f"cannot decode image: {e}") from e
    return resize_pixels(hwc, size, resize, interpolation)


def load_rgb(
    data: bytes, size: int, resize: str = "crop", max_pixels: int = 89_478_485, draft_ratio: float = 1.0
) -> Image.Image:
    """The decoded, upright RGB image, at reduced scale when a JPEG is much larger than needed.

    libjpeg decodes at 1/2, 1/4 or 1/8 scale for about the price of the smaller image. With
    ``draft_ratio`` 1.0 the decoded image still covers ``size`` (no upsampling, exact); below 1
    it may be as small as ``draft_ratio * size`` and is then upsampled (faster, a little softer).
    """
    im = open_image(data, max_pixels)
    if im.format == "JPEG":
        im.draft(None, _draft_size(im.size, size * draft_ratio, resize))
    return to_rgb(_oriented(im))


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Open (header only) and refuse empty files, non-images and decompression bombs."""
    if not data:
        raise ImageError("empty file (0 bytes)")
    try:
        im = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as e:
        raise ImageError("not an image Pillow can read (wrong extension or corrupt header)") from e
    except Image.DecompressionBombError as e:
        raise ImageError(f"decompression bomb refused by Pillow: {e}") from e
    w, h = im.size
    if w * h > max_pixels:
        raise ImageError(
            f"{w}x{h} = {w * h} pixels exceeds data.max_image_pixels ({max_pixels}): "
            "refused as a possible decompression bomb"
        )
    if w < 1 or h < 1:
        raise ImageError(f"image has no pixels ({w}x{h})")
    return im


def _draft_size(wh: tuple[int, int], size: float, resize: str) -> tuple[int, int]:
    """The smallest decode size whose kept region is still at least ``size`` on each side."""
    w, h = wh
    if resize == "squash":
        return (min(w, math.ceil(size)), min(h, math.ceil(size)))
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


def resize_pixels(hwc: torch.Tensor, size: int, resize: str = "crop", interpolation: str = "bicubic") -> torch.Tensor:
    """uint8 [H, W, 3] -> [3, size, size]: shorter side to ``size`` then center crop ("crop"),
    or both sides to ``size`` ("squash"). The crop is a view, so only kept pixels are resampled.
    ``interpolation`` is "bicubic" or "bilinear", both antialiased."""
    h, w = hwc.shape[:2]
    if resize != "squash":
        side = min(w, h)
        top, left = (h - side) // 2, (w - side) // 2
        hwc = hwc[top : top + side, left : left + side]
    chw = hwc.permute(2, 0, 1)  # a channels-last view: the layout the uint8 kernel is fastest on
    if chw.shape[1:] != (size, size):
        return F.interpolate(chw[None], size=(size, size), mode=interpolation, antialias=True)[0].contiguous()
    return chw.clone(memory_format=torch.contiguous_format)  # never a view of the caller's pixels
