"""Multi-caption retrieval sets (COCO, Flickr30k): images, their captions, and which image each
caption belongs to.

Two COCO-style JSON layouts are read:

- the Karpathy split file (``dataset_coco.json``, ``dataset_flickr30k.json``): ``images[]`` with
  ``filename`` (and ``filepath`` for COCO), ``split`` and ``sentences[].raw``; one split is taken;
- the annotations file (``captions_val2014.json``): ``images[]`` with ``id`` and ``file_name``, and
  ``annotations[]`` with ``image_id`` and ``caption``; every image with a caption is taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vltrain.errors import DataError


@dataclass
class CaptionedImages:
    images: list[str]
    captions: list[str]
    image_of: list[int]
    """Caption ``j`` belongs to image ``image_of[j]``."""


def open_captions(path: str | Path, split: str = "test", image_root: str | Path = "") -> CaptionedImages:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"caption file not found: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{p} is not valid JSON: {e}") from None
    root = Path(image_root) if image_root else p.parent
    if isinstance(data, dict) and "annotations" in data:
        out = _annotations(data, root)
    elif isinstance(data, dict) and isinstance(data.get("images"), list):
        out = _karpathy(data, root, split, p)
    else:
        raise DataError(f"{p}: expected COCO-style JSON: {{'images': [...]}} with sentences (Karpathy split) "
                        "or with an 'annotations' list")
    if not out.captions:
        raise DataError(f"{p}: no captioned images" + (f" in split {split!r}" if "annotations" not in data else ""))
    return out


def _karpathy(data: dict, root: Path, split: str, p: Path) -> CaptionedImages:
    out = CaptionedImages([], [], [])
    splits, in_split = set(), 0
    for im in data["images"]:
        splits.add(im.get("split"))
        in_split += im.get("split") == split
        if im.get("split") != split or not im.get("sentences"):
            continue
        out.images.append(str(root / im.get("filepath", "") / im["filename"]))
        for s in im["sentences"]:
            out.captions.append(s["raw"] if isinstance(s, dict) else str(s))
            out.image_of.append(len(out.images) - 1)
    if not out.images and in_split:
        raise DataError(f"{p}: none of the {in_split} image(s) of split {split!r} has a reference caption (every "
                        "'sentences' list is empty); captions are scored against references: give a file that has them")
    if not out.images and splits:
        raise DataError(f"{p}: no images in split {split!r} (its splits: {', '.join(sorted(map(str, splits)))})")
    return out


def _annotations(data: dict, root: Path) -> CaptionedImages:
    files = {im["id"]: im["file_name"] for im in data.get("images", [])}
    by_image: dict[int, list[str]] = {}
    for a in data["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a["caption"])
    out = CaptionedImages([], [], [])
    for image_id in sorted(by_image):
        if image_id not in files:
            continue
        out.images.append(str(root / files[image_id]))
        out.captions += by_image[image_id]
        out.image_of += [len(out.images) - 1] * len(by_image[image_id])
    return out
