"""Images at their own aspect ratio within a patch budget (SigLIP 2 "NaFlex"): bytes -> uint8 patches.

The rule: an image is resized to the largest grid of patches whose count is within ``max_patches``,
its aspect ratio kept and each side a multiple of the patch. The grid is found as transformers'
``get_image_size_for_max_num_patches`` finds it (a bisection over the scale, each side rounded up
to whole patches), so a model trained here sees the grids it sees under the HF processor.

The resize is Pillow's, on the fully decoded image (no JPEG draft, no simplejpeg): the pixels are
then those of HF's ``Siglip2ImageProcessorPil``. torch's antialiased ``F.interpolate`` on uint8
rounds differently, a level off on some pixels of detailed images; without antialiasing it is far
off whenever the image shrinks.

Padding the patches to a fixed length (and its attention mask) and normalization happen later,
per batch, where the batch is built: this module returns only the valid patches, as uint8.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

from vltrain.data.config import MAX_IMAGE_PIXELS, check_patch_budget
from vltrain.data.images import DECODE_ERRORS, ImageError, Seen, open_image, to_rgb, upright
from vltrain.errors import ConfigError
from vltrain.pixels import patchify, resample_code

# The bisection's stopping width, and its bounds on the scale: transformers' values, which the
# equality of grids depends on.
SCALE_EPS = 1e-5
SCALE_LOW, SCALE_HIGH = SCALE_EPS / 10, 100.0


def native_grid(
    height: int, width: int, patch: int, max_patches: int, min_patches: int = 1, upscale: bool = True
) -> tuple[int, int]:
    """The grid (rows, cols) of patches an image of ``height`` x ``width`` pixels is resized to.

    With ``upscale`` it is the largest grid within ``max_patches`` (HF's grid exactly). Without it
    an image is never enlarged: one already within the budget keeps its own size, rounded up to
    whole patches, unless that is under ``min_patches``; it is then enlarged to the smallest grid
    reaching ``min_patches``, or, where none lies within ``max_patches`` (a square image has only
    k x k grids), to the largest grid within it."""
    check_patch_budget(min_patches, max_patches)
    if upscale:
        return _largest_grid(height, width, patch, max_patches)
    rows, cols = _grid_at(1.0, height, width, patch)
    if rows * cols > max_patches:
        return _largest_grid(height, width, patch, max_patches)
    if rows * cols >= min_patches:
        return rows, cols
    return _smallest_grid_reaching(height, width, patch, min_patches, max_patches)


def patch_counts(sizes: np.ndarray, has_image: np.ndarray, patch: int, max_patches: int, min_patches: int = 1,
                 upscale: bool = True) -> np.ndarray:
    """int32 [n]: the patches each image becomes, from ``sizes`` ([n, 2] height and width); 0 for a
    row without an image, and the whole budget for one whose size is unknown (0 x 0: its header
    could not be read). Each distinct size is solved once: a dataset has few of them."""
    sizes = np.asarray(sizes)
    if len(sizes) == 0:
        return np.zeros(0, dtype=np.int32)
    distinct, inverse = np.unique(sizes, axis=0, return_inverse=True)
    counts = np.array([max_patches if h == 0 or w == 0 else math.prod(native_grid(h, w, patch, max_patches,
                                                                                    min_patches, upscale))
                       for h, w in distinct.tolist()], dtype=np.int32)
    return np.where(np.asarray(has_image, dtype=bool), counts[inverse.reshape(-1)], 0).astype(np.int32)


def _grid_at(scale: float, height: int, width: int, patch: int) -> tuple[int, int]:
    """The grid of an image scaled by ``scale``: each side rounded up to whole patches, at least one."""
    return max(1, math.ceil(height * scale / patch)), max(1, math.ceil(width * scale / patch))


def _bisect(past, low: float, high: float) -> tuple[float, float]:
    """Narrow [low, high] to SCALE_EPS around the scale where ``past(scale)`` turns True (False
    at ``low``, True at ``high``); the midpoints are transformers', so the ends are too."""
    while high - low >= SCALE_EPS:
        mid = (low + high) / 2
        if past(mid):
            high = mid
        else:
            low = mid
    return low, high


def _largest_scale(height: int, width: int, patch: int, max_patches: int) -> float:
    """The largest scale found whose grid is within ``max_patches``."""

    def too_big(scale: float) -> bool:
        rows, cols = _grid_at(scale, height, width, patch)
        return rows * cols > max_patches

    return _bisect(too_big, SCALE_LOW, SCALE_HIGH)[0]


def _largest_grid(height: int, width: int, patch: int, max_patches: int) -> tuple[int, int]:
    return _grid_at(_largest_scale(height, width, patch, max_patches), height, width, patch)


def _smallest_grid_reaching(height: int, width: int, patch: int, min_patches: int, max_patches: int) -> tuple[int, int]:
    """The grid at the smallest scale above 1 whose patch count reaches ``min_patches``, if one is
    within ``max_patches``; otherwise the largest grid within ``max_patches``. The search stops at
    the largest scale, so the grid it finds never overshoots the budget."""
    top = _largest_scale(height, width, patch, max_patches)
    rows, cols = _grid_at(top, height, width, patch)
    if rows * cols < min_patches:
        return rows, cols

    def reaches(scale: float) -> bool:
        rows, cols = _grid_at(scale, height, width, patch)
        return rows * cols >= min_patches

    return _grid_at(_bisect(reaches, 1.0, top)[1], height, width, patch)


def resample_filter(resample: str | int) -> Image.Resampling:
    """Pillow's filter for a name ("bilinear") or Pillow's integer code (2), as HF configs store it."""
    return Image.Resampling(resample_code(resample))


def decode_native(
    data: bytes, patch: int, max_patches: int, *, min_patches: int = 1, upscale: bool = True,
    resample: str | int = "bilinear", max_pixels: int = MAX_IMAGE_PIXELS,
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Decode, orient, convert to RGB and resize to its native grid; uint8 patches
    [rows * cols, 3 * patch * patch] in row-major grid order, channel-first within a patch, and
    the grid (rows, cols). Raises ImageError, with the reason, for an image that cannot be used."""
    patches, grid, _ = decode_native_seen(data, patch, max_patches, min_patches=min_patches, upscale=upscale,
                                          resample=resample, max_pixels=max_pixels)
    return patches, grid


def decode_native_seen(
    data: bytes, patch: int, max_patches: int, *, min_patches: int = 1, upscale: bool = True,
    resample: str | int = "bilinear", max_pixels: int = MAX_IMAGE_PIXELS,
) -> tuple[torch.Tensor, tuple[int, int], Seen]:
    """:func:`decode_native`'s patches and grid, and what they hold of the image: all of it, the
    whole image resized to rows * p x cols * p."""
    filt = resample_filter(resample)
    try:
        im = open_image(data, max_pixels)
        im = to_rgb(upright(im))  # as load_rgb; no copy when already upright
        seen = Seen(im.width, im.height, (0.0, 0.0, float(im.width), float(im.height)))
        rows, cols = native_grid(im.height, im.width, patch, max_patches, min_patches, upscale)
        im = im.resize((cols * patch, rows * patch), filt)
    except (ImageError, ConfigError):  # a bad budget is the setting's fault, not the image's
        raise
    except DECODE_ERRORS as e:
        raise ImageError(f"cannot decode image: its data is truncated or corrupt (the decoder said: {e})") from e
    hwc = torch.from_numpy(np.array(im))  # [H, W, 3], a writable copy of Pillow's pixels
    return patchify(hwc.permute(2, 0, 1), patch), (rows, cols), seen
