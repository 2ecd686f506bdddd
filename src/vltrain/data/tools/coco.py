"""``vltrain data from-coco``: COCO-style annotations as a JSONL manifest with regions.

COCO's ``instances_*.json`` gives each image's objects (``bbox`` [x, y, w, h] in pixels, a category);
RefCOCO-style refs (``refs.json``: ``{"image_id", "ann_id", "sentences": [{"sent"}], "split"}``, the
``refs(unc).p`` pickle's records written as JSON) give phrases that refer to one object; COCO's
``captions_*.json`` a caption per image. Each image becomes a row: its file, a caption when there is
one, and a region per object: one per referring phrase of the object, or its category's name when
it has none. Referring phrases come first (``data.max_regions`` keeps a row's first regions), then
the other objects, largest first. Crowd annotations (``iscrowd`` 1: a group, not one object) are
left out; a box that runs past its image (COCO's float boxes do, by a fraction of a pixel) is
clipped to it, and one with no area left is left out; all of them counted.

COCO's boxes are on the image as stored; vltrain's are on the image as shown. For the few COCO
images with an EXIF orientation, ``vltrain data validate`` names the boxes that do not fit.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from vltrain.errors import DataError, UsageError

INSTANCES = "COCO's instances_*.json holds \"images\", \"annotations\" and \"categories\""


@dataclass
class CocoReport:
    rows: int = 0
    images: int = 0
    referring: int = 0
    """Regions with a referring phrase."""
    named: int = 0
    """Regions named by their category."""
    crowd: int = 0
    clipped: int = 0
    empty: int = 0
    captions: int = 0


def _read(path: str | os.PathLike, what: str):
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{what} {path}: not found")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None


class _Fields:
    """Typed reads of one JSON file's records, each failure naming the file and the key."""

    def __init__(self, path: str | os.PathLike):
        self.name = Path(path).name

    def list(self, doc, key: str, hint: str) -> list:
        if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
            raise DataError(f'{self.name}: no "{key}" list ({hint})')
        return doc[key]

    def get(self, item, key: str, kinds: tuple, where: str, default=None, required: bool = True):
        if not isinstance(item, dict):
            raise DataError(f"{self.name}: {where} must be an object, got {type(item).__name__}")
        value = item.get(key, default)
        if (value is None and not required) or (isinstance(value, kinds) and not isinstance(value, bool)):
            return value
        want = " or ".join(k.__name__ for k in kinds)
        raise DataError(f'{self.name}: {where}: "{key}" must be {want}, got {json.dumps(value, default=str)}')


def _images(doc, f: _Fields) -> dict[int, dict]:
    images = {}
    for k, item in enumerate(f.list(doc, "images", INSTANCES)):
        where = f'"images"[{k}]'
        image_id = f.get(item, "id", (int, str), where)
        size = [f.get(item, key, (int, float), where) for key in ("width", "height")]
        images[image_id] = {"file": f.get(item, "file_name", (str,), where), "size": size}
    return images


def _objects(doc, f: _Fields, images: dict, report: CocoReport) -> tuple[dict, set]:
    """{annotation id: (image id, box, category name)} of the usable annotations, in the file's
    order; and the ids of every annotation (crowds and empty boxes too)."""
    names = {f.get(c, "id", (int, str), f'"categories"[{k}]'): f.get(c, "name", (str,), f'"categories"[{k}]')
             for k, c in enumerate(f.list(doc, "categories", INSTANCES))}
    objects, every = {}, set()
    for k, a in enumerate(f.list(doc, "annotations", INSTANCES)):
        where = f'"annotations"[{k}]'
        image_id, category = f.get(a, "image_id", (int, str), where), f.get(a, "category_id", (int, str), where)
        if image_id not in images:
            raise DataError(f'{f.name}: {where}: "image_id" {json.dumps(image_id)} is not in "images"')
        if category not in names:
            raise DataError(f'{f.name}: {where}: "category_id" {json.dumps(category)} is not in "categories"')
        bbox = f.get(a, "bbox", (list,), where)
        if len(bbox) != 4 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox):
            raise DataError(f'{f.name}: {where}: "bbox" must be 4 numbers [x, y, width, height], '
                            f"got {json.dumps(bbox, default=str)}")
        ann = f.get(a, "id", (int, str), where)
        every.add(ann)
        if f.get(a, "iscrowd", (int,), where, default=0):
            report.crowd += 1
            continue
        box = _clipped(bbox, images[image_id]["size"], report)
        if box is not None:
            objects[ann] = (image_id, box, names[category])
    return objects, every


def _clipped(bbox: list, size: list, report: CocoReport) -> list[float] | None:
    x, y, w, h = bbox
    width, height = size
    box = [max(0.0, x), max(0.0, y), min(float(width), x + w), min(float(height), y + h)]
    if box[0] >= box[2] or box[1] >= box[3]:
        report.empty += 1
        return None
    report.clipped += box != [x, y, x + w, y + h]
    return [round(v, 2) for v in box]


def _referring(path, objects: dict, every: set, split: str) -> dict:
    """{annotation id: [phrases]} of the refs (of ``split`` only, when given), in their order."""
    f, refs = _Fields(path), _read(path, "--refs")
    if not isinstance(refs, list):
        raise DataError(f"{f.name}: must be a list of refs {{\"image_id\", \"ann_id\", \"sentences\", \"split\"}}")
    phrases: dict = defaultdict(list)
    for k, ref in enumerate(refs):
        where = f"[{k}]"
        if split and f.get(ref, "split", (str,), where) != split:
            continue
        ann = f.get(ref, "ann_id", (int, str), where)
        if ann not in every:
            raise DataError(f'{f.name}: {where}: "ann_id" {json.dumps(ann)} is not in the instances\' "annotations" '
                            "(refs and instances of different sets?)")
        for j, sentence in enumerate(f.get(ref, "sentences", (list,), where)):
            at = f'{where}: "sentences"[{j}]'
            sent = f.get(sentence, "sent", (str,), at, required=False)
            sent = sent if sent is not None else f.get(sentence, "raw", (str,), at)
            if ann in objects and sent.strip():  # not a crowd's or an empty box's
                phrases[ann].append(sent.strip())
    return phrases


def _captions(path, images: dict, report: CocoReport) -> dict:
    """{image id: [captions]}, in the file's order."""
    f = _Fields(path)
    doc = _read(path, "--captions")
    out: dict = defaultdict(list)
    hint = "COCO's captions_*.json holds \"images\" and \"annotations\" of {\"image_id\", \"caption\"}"
    for k, a in enumerate(f.list(doc, "annotations", hint)):
        where = f'"annotations"[{k}]'
        image_id, caption = f.get(a, "image_id", (int, str), where), f.get(a, "caption", (str,), where)
        if image_id in images and caption.strip():
            out[image_id].append(caption.strip())
    report.captions = sum(len(v) for v in out.values())
    return out


def from_coco(instances: str, images_dir: str, out: str, refs: str | None = None, captions: str | None = None,
              split: str = "", all_captions: bool = False) -> CocoReport:
    """Write the manifest ``out`` (JSONL) from COCO-style files; see the module's docstring.
    ``split``: only refs of that split, and only the images they refer to; ``all_captions``: a row
    per caption (they share the image's id, so they are never each other's negatives), else the
    image's first caption."""
    if split and not refs:
        raise UsageError("--split picks the refs of one split: give --refs too")
    if not Path(images_dir).is_dir():
        raise UsageError(f"--images {images_dir}: not a folder")
    report = CocoReport()
    f = _Fields(instances)
    doc = _read(instances, "--instances")
    images = _images(doc, f)
    objects, every = _objects(doc, f, images, report)
    phrases = _referring(refs, objects, every, split) if refs else {}
    texts = _captions(captions, images, report) if captions else {}
    by_image: dict = defaultdict(list)
    for ann, (image_id, _, _) in objects.items():
        by_image[image_id].append(ann)
    referred = {objects[ann][0] for ann in phrases}
    chosen = [i for i in images if not split or i in referred]
    folder, base = Path(images_dir).resolve(), Path(out).parent.resolve()
    rows = []
    for image_id in chosen:
        row = {"id": image_id, "image": os.path.relpath(folder / images[image_id]["file"], base)}
        found = _regions(by_image[image_id], objects, phrases, report)
        row |= {"regions": found} if found else {}
        captions = texts.get(image_id) or [None]
        rows += [row | ({"text": c} if c else {}) for c in (captions if all_captions else captions[:1])]
    report.rows, report.images = len(rows), len(chosen)
    _write(Path(out), rows)
    return report


def _regions(anns: list, objects: dict, phrases: dict, report: CocoReport) -> list[dict]:
    """An image's regions: each referring phrase of its objects, then the objects without one,
    named by their category, largest first."""
    referring = [{"box": objects[a][1], "text": p} for a in anns for p in phrases.get(a, ())]
    named = [{"box": objects[a][1], "text": objects[a][2]} for a in anns if a not in phrases]
    named.sort(key=lambda r: -(r["box"][2] - r["box"][0]) * (r["box"][3] - r["box"][1]))
    report.referring += len(referring)
    report.named += len(named)
    return referring + named


def _write(out: Path, rows: list[dict]) -> None:
    """The manifest, written whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as sink:
        sink.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp, out)
