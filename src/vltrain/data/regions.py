"""Regions: boxes of an image, each with a phrase (referring expressions, grounded captions: the
data of SigLIP 2's LocCa decoder tasks).

A row may carry ``"regions": [{"box": [x0, y0, x1, y1], "text": "..."}]``, the box in pixels of the
image as shown (upright, after its EXIF orientation), pixel edges: a box around pixels 10 to 19 runs
from 10 to 20. What makes a region usable is decided here, once, for the loader and ``vltrain data
validate`` alike (:func:`parse_regions`, :func:`check_inside`); and each box is mapped here through
what the decoder did to the pixels (:func:`place_regions`): the decoder says which part of the
shown image the model sees (:class:`~vltrain.data.images.Seen`: a center crop's square, or all of
it), and a box becomes x0, y0, x1, y1 in [0, 1] of that part, x by its width, y by its height. The
draft scale, the resize and a native grid stretch the whole part alike, so they change nothing in
those coordinates.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vltrain.data.images import Seen, shown_size

KEPT_SHARE = 0.5
"""A region keeps when at least this share of its box's area lies in the part of the image the model
sees; it is then clipped to that part. A region with less inside is dropped and counted (a crop
cut it away): half a person, cut at the waist, is still the person; a sliver of them is not."""


class RegionError(ValueError):
    """A row's regions that cannot be used; the message names the region and says what is wrong."""


@dataclass(frozen=True)
class Region:
    box: tuple[float, float, float, float]
    """x0, y0, x1, y1 in pixels of the image as shown."""
    text: str


@dataclass
class Placed:
    """A row's regions as the model sees its image."""

    boxes: np.ndarray
    """float32 [R, 4]: x0, y0, x1, y1 in [0, 1] of the image the model sees, in the row's order."""
    texts: list[str]
    cut: int = 0
    """Regions dropped because the crop left less than ``KEPT_SHARE`` of them."""
    capped: int = 0
    """Regions dropped past ``data.max_regions``."""


def parse_regions(value) -> tuple[Region, ...]:
    """A row's ``regions`` as given (a list, or in a CSV cell or a parquet string column the JSON
    text of one), checked in form: a list of ``{"box": [4 numbers], "text": "..."}`` with
    x0 < x1, y0 < y1 and a phrase that is not blank. Raises :class:`RegionError` naming the first
    region that is not."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise RegionError(f"regions: not JSON ({e})") from None
    if not isinstance(value, list):
        raise RegionError(f"regions: must be a list of {{\"box\", \"text\"}}, got {type(value).__name__}")
    return tuple(_region(k, item) for k, item in enumerate(value))


def _region(k: int, item) -> Region:
    if not isinstance(item, dict):
        raise RegionError(f"regions[{k}]: must be an object {{\"box\", \"text\"}}, got {type(item).__name__}")
    box, text = item.get("box"), item.get("text")
    numbers = isinstance(box, (list, tuple)) and len(box) == 4 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)
    if not numbers:
        given = json.dumps(box, default=str)
        raise RegionError(f"regions[{k}]: box must be 4 numbers [x0, y0, x1, y1], got {given}")
    x0, y0, x1, y1 = (float(v) for v in box)
    if not (x0 < x1 and y0 < y1):
        raise RegionError(f"regions[{k}]: box {_shown(box)} is empty or inverted (it needs x0 < x1 and y0 < y1)")
    if not isinstance(text, str) or not text.strip():
        raise RegionError(f"regions[{k}]: text must be a phrase, got {json.dumps(text, default=str)}")
    return Region((x0, y0, x1, y1), text)


def check_inside(regions: tuple[Region, ...], width: int, height: int) -> None:
    """Raise :class:`RegionError` for the first box that is not inside an image of ``width`` x
    ``height`` pixels as shown."""
    for k, r in enumerate(regions):
        x0, y0, x1, y1 = r.box
        if x0 < 0 or y0 < 0 or x1 > width or y1 > height:
            raise RegionError(f"regions[{k}]: box {_shown(r.box)} is not inside the {width}x{height} image "
                              "(boxes are in pixels of the image as shown, after its EXIF orientation)")


def _shown(box) -> str:
    return "[" + ", ".join(f"{v:g}" for v in box) + "]"


def place_regions(regions: tuple[Region, ...], seen: Seen, most: int) -> Placed:
    """``regions`` mapped into the part of the image the model sees (``seen.window``): each clipped
    to it, or dropped and counted when less than ``KEPT_SHARE`` of it lies inside; then the first
    ``most`` kept, the rest counted."""
    wx0, wy0, wx1, wy1 = seen.window
    width, height = wx1 - wx0, wy1 - wy0
    boxes, texts = [], []
    for r in regions:
        x0, y0, x1, y1 = r.box
        cx0, cy0, cx1, cy1 = max(x0, wx0), max(y0, wy0), min(x1, wx1), min(y1, wy1)
        inside = max(0.0, cx1 - cx0) * max(0.0, cy1 - cy0)
        if inside < KEPT_SHARE * (x1 - x0) * (y1 - y0):
            continue
        boxes.append(((cx0 - wx0) / width, (cy0 - wy0) / height, (cx1 - wx0) / width, (cy1 - wy0) / height))
        texts.append(r.text)
    kept = min(len(boxes), most)
    out = np.clip(np.asarray(boxes[:kept], dtype=np.float64).reshape(-1, 4), 0.0, 1.0).astype(np.float32)
    return Placed(out, texts[:kept], cut=len(regions) - len(boxes), capped=len(boxes) - kept)


def resized_regions(value, before: bytes, after: bytes):
    """A row's regions (as given) for its image written anew at another size (``vltrain data shard
    --image-size``): each box scaled by the ratio of the two images' sizes as shown. Regions that
    cannot be read are carried as they are, for ``vltrain data validate`` to name."""
    try:
        regions = parse_regions(value)
    except RegionError:
        return value
    (h0, w0), (h1, w1) = (shown_size(Image.open(io.BytesIO(data))) for data in (before, after))
    if (h0, w0) == (h1, w1):
        return value
    sx, sy = w1 / w0, h1 / h0
    return [{"box": [round(x0 * sx, 2), round(y0 * sy, 2), round(x1 * sx, 2), round(y1 * sy, 2)], "text": r.text}
            for r in regions for x0, y0, x1, y1 in [r.box]]


def decoded_regions(value):
    """Regions as a JSON value (a shard's ``.json`` stores them so): the JSON text of a CSV cell or
    a parquet string column decoded, anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
