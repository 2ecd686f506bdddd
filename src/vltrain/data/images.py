"""Image decoding: encoded bytes -> uint8 [3, S, S], the only per-sample image work.

Normalization is not done here: it is one float op per batch where the batch lands
(``Batch.pixels``), so workers move 4x fewer bytes and do no float math. The resize runs on
the uint8 pixels with torch's antialiased bicubic kernel, as close to a Lanczos reference as
Pillow's bicubic and cheaper (docs/benchmarks/data.md, "Data pipeline", the resize table).

JPEGs (most real data) are decoded by simplejpeg when it is installed: libjpeg-turbo writing
straight into one numpy array, at the smallest M/8 scale that still covers the output (DCT
scaling: a 500x375 photo going to 224 is decoded at 313x235), so fewer pixels are decoded,
copied and resized. Everything else, and any JPEG simplejpeg refuses, goes through Pillow.
"""

from __future__ import annotations

import io
import math
import struct
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ExifTags, Image, UnidentifiedImageError

from vltrain.data.config import MAX_IMAGE_PIXELS

try:
    import simplejpeg
except ImportError:  # optional at run time: Pillow decodes JPEGs too, a little slower
    simplejpeg = None

# decode_image wraps the read-only bytes of a decoded image and never writes to them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)
# An image over the pixel limit is refused by check_pixels and reported as a bad sample (counted, in
# bad_samples.jsonl); Pillow's own warning would only print a site-packages path once per process.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

WHITE = (255, 255, 255, 255)
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")

# The M of the M/8 scales simplejpeg may decode at. libjpeg-turbo's SIMD inverse DCTs are for
# 1/8, 2/8, 4/8 and 8/8; the other scales run in plain C. 3/8 and 5/8 still pay through the
# smaller resize; 6/8 and 7/8 measured slower than a full decode plus resize, so they are skipped
# (docs/benchmarks/data.md, "Data pipeline").
JPEG_SCALES = (1, 2, 3, 4, 5, 8)
JPEG_START = b"\xff\xd8"
ORIENTATIONS = {
    2: (Image.Transpose.FLIP_LEFT_RIGHT, ("flip_x",)),
    3: (Image.Transpose.ROTATE_180, ("flip_x", "flip_y")),
    4: (Image.Transpose.FLIP_TOP_BOTTOM, ("flip_y",)),
    5: (Image.Transpose.TRANSPOSE, ("transpose",)),
    6: (Image.Transpose.ROTATE_270, ("transpose", "flip_x")),
    7: (Image.Transpose.TRANSVERSE, ("transpose", "flip_x", "flip_y")),
    8: (Image.Transpose.ROTATE_90, ("transpose", "flip_y")),
}
"""EXIF orientation -> what makes the image upright: as one Pillow transpose (ImageOps.exif_transpose's
own) and as the same flips and transpose of an [H, W, C] array, in order. Those with a transpose
turn the image a quarter: its width and height trade places."""

# What Pillow raises on broken input. A bug in our code (TypeError, ...) is not caught.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error, zlib.error)


class ImageError(ValueError):
    """An image that cannot be used; the message is the reason shown to the user."""


@dataclass(frozen=True)
class Seen:
    """Which part of an image as shown (upright) a decoded image holds: the ``window`` (x0, y0, x1, y1),
    in the shown image's pixels (their edges: pixel i spans [i, i + 1)), that becomes the decoded
    image's [0, 1] x [0, 1]: a center crop's square, or the whole image. It may reach a fraction of
    a pixel past the image, where a JPEG decoded at reduced scale rounds its size up. Regions'
    boxes are mapped through it (:mod:`vltrain.data.regions`)."""

    width: int
    """The image as shown."""
    height: int
    window: tuple[float, float, float, float]


@dataclass(frozen=True)
class _Frame:
    """What a decoder knows of the image it decoded: its size as shown, and the decoded pixels per
    shown pixel (below 1 at a JPEG's reduced scale)."""

    width: int
    height: int
    scale: float

    def seen(self, height: int, width: int, resize: str) -> Seen:
        """The part of the image decoded at ``height`` x ``width`` that ``resize_pixels`` keeps."""
        top, left, kept_h, kept_w = _kept(height, width, resize)
        s = self.scale
        return Seen(self.width, self.height, (left / s, top / s, (left + kept_w) / s, (top + kept_h) / s))


def decode_image(
    data: bytes, size: int, resize: str = "crop", max_pixels: int = MAX_IMAGE_PIXELS, draft_ratio: float = 1.0,
    interpolation: str = "bicubic", jpeg_decoder: str = "auto",
) -> torch.Tensor:
    """Decode, orient, convert to RGB, resize to ``size`` x ``size``; uint8 CHW.

    ``jpeg_decoder`` "auto" decodes JPEGs with simplejpeg when it is installed, "pillow" never."""
    return decode_seen(data, size, resize, max_pixels, draft_ratio, interpolation, jpeg_decoder)[0]


def decode_seen(
    data: bytes, size: int, resize: str = "crop", max_pixels: int = MAX_IMAGE_PIXELS, draft_ratio: float = 1.0,
    interpolation: str = "bicubic", jpeg_decoder: str = "auto",
) -> tuple[torch.Tensor, Seen]:
    """:func:`decode_image`'s pixels, and which part of the image as shown they hold (:class:`Seen`)."""
    try:
        found = None
        if jpeg_decoder == "auto" and simplejpeg is not None and data[:2] == JPEG_START:
            found = _jpeg(data, size * draft_ratio, resize, max_pixels)
        if found is None:
            im, frame = _pillow(data, size, resize, max_pixels, draft_ratio)
            # Pillow's pixels are copied out once (tobytes) and wrapped, not copied again by numpy;
            # resize_pixels only reads them.
            found = torch.frombuffer(im.tobytes(), dtype=torch.uint8).view(im.height, im.width, 3), frame
    except ImageError:
        raise
    except DECODE_ERRORS as e:
        raise ImageError(f"cannot decode image: its data is truncated or corrupt (the decoder said: {e})") from e
    hwc, frame = found
    return resize_pixels(hwc, size, resize, interpolation), frame.seen(*hwc.shape[:2], resize)


def image_problem(e: Exception, image: str | None) -> str:
    """The image's path and a plain reason, for a read or decode failure of ``image``."""
    if isinstance(e, FileNotFoundError):
        return f"image file not found: {image}"
    if isinstance(e, IsADirectoryError):
        return f"{image}: is a directory, not an image file"
    if isinstance(e, PermissionError):
        return f"{image}: permission denied (the file is not readable by this user)"
    if isinstance(e, ImageError):
        return f"{image}: {e}"
    if isinstance(e, OSError):
        return f"{image}: cannot read the file ({e.strerror or e})"
    return f"{image}: {e}"


def load_rgb(
    data: bytes, size: int, resize: str = "crop", max_pixels: int = MAX_IMAGE_PIXELS, draft_ratio: float = 1.0
) -> Image.Image:
    """The decoded, upright RGB image, at reduced scale when a JPEG is much larger than needed.

    libjpeg decodes at 1/2, 1/4 or 1/8 scale for about the price of the smaller image. With
    ``draft_ratio`` 1.0 the decoded image still covers ``size`` (no upsampling, exact); below 1
    it may be as small as ``draft_ratio * size`` and is then upsampled (faster, a little softer).
    """
    return _pillow(data, size, resize, max_pixels, draft_ratio)[0]


def _pillow(data: bytes, size: int, resize: str, max_pixels: int, draft_ratio: float) -> tuple[Image.Image, _Frame]:
    """:func:`load_rgb`'s image, and its frame."""
    im = open_image(data, max_pixels)
    height, width = shown_size(im)
    scale = 1.0
    if im.format == "JPEG":
        stored_width = im.size[0]
        drafted = im.draft(None, _draft_size(im.size, size * draft_ratio, resize))
        if drafted:  # (mode, box): box is the whole image in decoded pixels, (0, 0, W / s, H / s)
            scale = drafted[1][2] / stored_width
    return to_rgb(upright(im)), _Frame(width, height, scale)


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
    check_pixels(*im.size, max_pixels)
    return im


def check_pixels(w: int, h: int, max_pixels: int) -> None:
    """Refuse, from the header alone, images with no pixels or too many (decompression bombs)."""
    if w * h > max_pixels:
        raise ImageError(
            f"{w}x{h} = {w * h} pixels exceeds data.max_image_pixels ({max_pixels}): "
            "refused as a possible decompression bomb"
        )
    if w < 1 or h < 1:
        raise ImageError(f"image has no pixels ({w}x{h})")


def _draft_size(wh: tuple[int, int], size: float, resize: str) -> tuple[int, int]:
    """The smallest decode size whose kept region is still at least ``size`` on each side."""
    w, h = wh
    if resize == "squash":
        return (min(w, math.ceil(size)), min(h, math.ceil(size)))
    s = size / min(w, h)
    return (min(w, math.ceil(w * s)), min(h, math.ceil(h * s)))


def load_jpeg(
    data: bytes, size: float, resize: str = "crop", max_pixels: int = MAX_IMAGE_PIXELS
) -> torch.Tensor | None:
    """The upright RGB pixels [H, W, 3] of a JPEG, decoded by simplejpeg at the smallest scale
    in JPEG_SCALES whose kept region still covers ``size`` on each side, so nothing is
    upsampled. The header is checked against ``max_pixels`` before any pixel is decoded.
    None for what it does not handle (CMYK and YCCK, data libjpeg-turbo warns about or cannot
    read): Pillow then decodes it and, if it is broken, says why.

    At the scales Pillow's draft also uses (1/2, 1/4, 1/8, full) the pixels are Pillow's; at
    3/8 and 5/8 the DCT scaling filters differently from the resize it saves, so the resized
    result differs slightly from Pillow's (bounded per size by tests/data/test_images.py;
    measured in docs/benchmarks/data.md, "Data pipeline")."""
    found = _jpeg(data, size, resize, max_pixels)
    return None if found is None else found[0]


def _jpeg(data: bytes, size: float, resize: str, max_pixels: int) -> tuple[torch.Tensor, _Frame] | None:
    """:func:`load_jpeg`'s pixels, and their frame."""
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ("YCbCr", "Gray"):
        return None
    check_pixels(w, h, max_pixels)
    need = _draft_size((w, h), size, resize)
    m = next(m for m in JPEG_SCALES if math.ceil(w * m / 8) >= need[0] and math.ceil(h * m / 8) >= need[1])
    try:
        rgb = simplejpeg.decode_jpeg(
            data, "rgb", min_width=math.ceil(w * m / 8), min_height=math.ceil(h * m / 8), strict=True
        )
    except ValueError:
        return None
    turn = orientation(Image.open(io.BytesIO(data))) if _may_be_rotated(data) else 1
    # libjpeg scales by m/8 and rounds the size up; a tiny image may come out at another scale
    scale = m / 8 if rgb.shape[1] == math.ceil(w * m / 8) else rgb.shape[1] / w
    return upright_pixels(torch.from_numpy(rgb), turn), _Frame(*turned(w, h, turn), scale)


def _may_be_rotated(data: bytes) -> bool:
    """Whether a JPEG's header holds an APP1 segment (EXIF or XMP, where Pillow finds the
    orientation), found by walking the segment lengths: Pillow then reads the header, and files
    without one (most web images) skip that parse. Anything odd answers True."""
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF or data[pos + 1] == 0xFF:
            return True
        marker = data[pos + 1]
        if marker == 0xDA:  # start of scan: the header is over
            return False
        if marker == 0xE1:
            return True
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return True


def orientation(im: Image.Image) -> int:
    """The EXIF orientation (in EXIF or XMP) of the header Pillow has read, no pixels decoded; 1
    (upright) for none or one outside 2-8. Every decoder and the size reader (``index/sizes.py``)
    read it here, so the size a patch budget plans from is the size of the decoded image."""
    turn = im.getexif().get(ExifTags.Base.Orientation, 1)
    return turn if isinstance(turn, int) and turn in ORIENTATIONS else 1


def upright(im: Image.Image) -> Image.Image:
    """The Pillow image as shown: one transpose (a copy), or the image itself when upright."""
    turn = orientation(im)
    return im if turn == 1 else im.transpose(ORIENTATIONS[turn][0])


def upright_pixels(hwc: torch.Tensor, turn: int) -> torch.Tensor:
    """[H, W, C] pixels of an image of orientation ``turn``, as shown: the pixels :func:`upright` gives."""
    for op in ORIENTATIONS[turn][1] if turn in ORIENTATIONS else ():
        hwc = hwc.transpose(0, 1) if op == "transpose" else hwc.flip(1 if op == "flip_x" else 0)
    return hwc


def shown_size(im: Image.Image) -> tuple[int, int]:
    """(height, width) of the image as shown (its orientation applied), from its header."""
    width, height = turned(*im.size, orientation(im))
    return height, width


def turned(width: int, height: int, turn: int) -> tuple[int, int]:
    """(width, height) of an image stored ``width`` x ``height``, once orientation ``turn`` is applied."""
    return (height, width) if turn in ORIENTATIONS and "transpose" in ORIENTATIONS[turn][1] else (width, height)


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
    top, left, kept_h, kept_w = _kept(*hwc.shape[:2], resize)
    hwc = hwc[top : top + kept_h, left : left + kept_w]
    chw = hwc.permute(2, 0, 1)  # a channels-last view: the layout the uint8 kernel is fastest on
    if chw.shape[1:] != (size, size):
        return F.interpolate(chw[None], size=(size, size), mode=interpolation, antialias=True)[0].contiguous()
    return chw.clone(memory_format=torch.contiguous_format)  # never a view of the caller's pixels


def shown_window(width: int, height: int, resize: str) -> tuple[float, float, float, float]:
    """The window (x0, y0, x1, y1, in pixels) of a ``width`` x ``height`` image as shown that a decoder
    keeps under ``data.resize``: the crop's centered square, or the whole image (squash, native)."""
    return _Frame(width, height, 1.0).seen(height, width, resize).window


def _kept(height: int, width: int, resize: str) -> tuple[int, int, int, int]:
    """(top, left, height, width) of the pixels ``resize_pixels`` keeps: the centered square of the
    shorter side ("crop"), or all of them ("squash"; "native" resizes the whole image to its own grid)."""
    if resize != "crop":
        return 0, 0, height, width
    side = min(width, height)
    return (height - side) // 2, (width - side) // 2, side, side
