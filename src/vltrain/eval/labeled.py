"""Evaluation sets that are not image-text pairs: labelled images (zero-shot classification),
their prompt templates, and the plain image and text lists the evaluators embed.

A labelled set is read from an ImageFolder-style folder (one sub-folder per class; class names
from the folder names with underscores as spaces, or from ``classnames.txt``, one per line in the
folders' sorted order) or from a JSONL/CSV manifest with an image and a label column (a label is a
class name, or an index into the ``classnames.txt`` beside the manifest).

An evaluation image that cannot be read is not replaced, as a training sample is: its row comes
back without an image and with the reason in ``Sample.errors``, so the evaluator leaves it out of
the metrics and counts it.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vltrain.data.config import DataConfig
from vltrain.data.dataset import Sample
from vltrain.data.ids import stable_uid
from vltrain.data.image_input import decode_for
from vltrain.data.images import ImageError, image_problem
from vltrain.data.sources.manifests import IMAGE_KEYS
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
LABEL_KEYS = ("label", "class", "classname")
CLASSNAMES_FILE = "classnames.txt"

DEFAULT_TEMPLATES = (
    "{}.",
    "a photo of a {}.",
    "an image showing a {}.",
    "a picture with a {} in it.",
    "a close view of the {}.",
    "a small {}.",
    "a large {}.",
    "there is a {} here.",
)
"""The built-in prompts: a short, generic set (in our own words) for sets without a templates file."""


@dataclass
class LabeledImages:
    """Image paths with a class index each, and the class names in index order."""

    images: list[str]
    labels: list[int]
    classnames: list[str]


def read_templates(path: str | Path | None) -> list[str]:
    """Templates from a file (one per line with ``{}``; blank lines and ``#`` comments skipped), or
    the built-in set."""
    if not path:
        return list(DEFAULT_TEMPLATES)
    p = Path(path)
    if not p.is_file():
        raise DataError(f"templates file not found: {p}")
    lines = [ln.strip() for ln in p.read_text().splitlines()]
    templates = [ln for ln in lines if ln and not ln.startswith("#")]
    bad = [t for t in templates if "{}" not in t]
    if not templates or bad:
        raise DataError(f"{p}: every template needs {{}} where the class name goes (e.g. 'a photo of a {{}}.'); "
                        + (f"first without: {bad[0]!r}" if bad else "the file has none"))
    return templates


def open_labeled(path: str | Path) -> LabeledImages:
    """A class-per-folder image set or a manifest with a label column (see the module docstring)."""
    p = Path(path)
    if p.is_dir():
        return _image_folder(p)
    if p.is_file() and p.suffix.lower() in (".jsonl", ".csv", ".tsv"):
        return _labeled_manifest(p)
    raise DataError(f"{p}: not a folder of class sub-folders nor a JSONL/CSV manifest with a label column")


def _classnames_file(folder: Path, count: int | None) -> list[str] | None:
    f = folder / CLASSNAMES_FILE
    if not f.is_file():
        return None
    names = [ln.strip() for ln in f.read_text().splitlines() if ln.strip()]
    if count is not None and len(names) != count:
        raise DataError(f"{f} names {len(names)} classes but {folder} has {count} class folders")
    return names


def _image_folder(root: Path) -> LabeledImages:
    folders = sorted(d for d in root.iterdir() if d.is_dir())
    if not folders:
        raise DataError(f"{root} has no class sub-folders (expected ROOT/CLASS_NAME/IMAGE)")
    classnames = _classnames_file(root, len(folders)) or [d.name.replace("_", " ") for d in folders]
    images, labels = [], []
    for k, d in enumerate(folders):
        files = sorted(f for f in d.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        images += [str(f) for f in files]
        labels += [k] * len(files)
    if not images:
        raise DataError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
    return LabeledImages(images, labels, classnames)


def _manifest_rows(path: Path) -> list[dict]:
    if path.suffix.lower() == ".jsonl":
        with open(path) as f:
            return [json.loads(ln) for ln in f if ln.strip()]
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))


def _first(row: dict, keys: tuple[str, ...], path: Path, line: int):
    for k in keys:
        if row.get(k) not in (None, ""):
            return row[k]
    raise DataError(f"{path}:{line}: no {' / '.join(keys)} column")


def _labeled_manifest(path: Path) -> LabeledImages:
    known = _classnames_file(path.parent, None)
    classnames = list(known or [])
    index = {c: i for i, c in enumerate(classnames)}
    images, labels = [], []
    for line, row in enumerate(_manifest_rows(path), start=1):
        image = str(_first(row, IMAGE_KEYS, path, line))
        label = _first(row, LABEL_KEYS, path, line)
        if isinstance(label, int) or (isinstance(label, str) and label.isdigit() and known):
            if not known or not 0 <= int(label) < len(known):
                raise DataError(f"{path}:{line}: label {label} needs a {CLASSNAMES_FILE} beside the manifest "
                                "with that many lines (or give class names as labels)")
            k = int(label)
        else:
            k = index.setdefault(str(label), len(index))
            if k == len(classnames):
                classnames.append(str(label))
        images.append(str(path.parent / image))
        labels.append(k)
    if not images:
        raise DataError(f"{path}: no rows")
    return LabeledImages(images, labels, classnames)


class ImageListDataset(torch.utils.data.Dataset):
    """``ds[i]``: image file ``i`` decoded as in training, with no text; an unreadable one comes back
    without an image and with its reason in ``errors``."""

    uses_random = False

    def __init__(self, images: list[str], cfg: DataConfig):
        self.images = images
        self.cfg = cfg

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Sample:
        path, c = self.images[i], self.cfg
        image, grid, errors = None, None, []
        try:
            with open(path, "rb") as f:
                data = f.read()
            image, grid = decode_for(data, c)
        except (ImageError, OSError) as e:
            errors.append((path, image_problem(e, path)))
        return Sample(stable_uid(path), path, image, [], False, 0, errors, grid)


class TextListDataset(torch.utils.data.Dataset):
    """``ds[i]``: text ``i`` tokenized as in training, with no image."""

    uses_random = False

    def __init__(self, texts: list[str], tokenizer: Tokenizer, max_length: int):
        self.texts = texts
        self.ids = tokenizer.encode_batch(texts, max_length)

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> Sample:
        return Sample(i, f"text-{i}", None, self.ids[i], False, 0)
