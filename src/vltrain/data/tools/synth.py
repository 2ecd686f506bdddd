"""The built-in "shapes" dataset: real image files plus JSONL manifests, deterministic from a seed.

Each image holds 1 to 3 coloured shapes on a 3x3 grid; its caption names every shape's size,
colour, kind and grid cell in varied wording; with regions, each shape's box and a phrase naming it. The caption is a function of the image, so a model
can learn to retrieve one from the other, and the held-out split measures whether it did. The
grid is aligned to the image (each cell is a third of the side), which lets a ViT whose patch is
a third of the image see one cell per patch.

With long captions (``--long-captions``), each image holds 6 to 9 shapes and its caption names them
all in reading order (top row first), a clause each, after a line that counts them: most run past
CLIP's 77 tokens, so that a model reading only the first 77 never sees the bottom row's shapes
(``docs/benchmarks/long-text.md`` gives the length distribution). They are drawn from a random
stream of their own, so the default data stays as it was.

With masks (``--masks``), each held-out image also gets a segmentation mask (``masks/val/NNNNNN.png``,
mode L, the image's size, each pixel its shape's class: 0 the background, then one per kind in
:data:`MASK_CLASSES` order), listed in ``dense.jsonl`` with the class names in ``dense_classes.json``
beside it (``docs/formats.md#dense-masks``). A mask is drawn from the image's own outlines and
takes nothing from its random stream, so the images and rows stay as they were.
"""

from __future__ import annotations

import json
import math
import os
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from vltrain.errors import UserError
from vltrain.runtime.cpus import usable_cpus

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 90, 230),
    "yellow": (240, 215, 40),
    "purple": (150, 60, 200),
    "orange": (250, 140, 20),
    "white": (245, 245, 245),
}
KINDS = ("circle", "square", "triangle", "diamond", "star", "cross")
SIZES = {"large": 0.82, "small": 0.46}  # fraction of the cell side
SIZE_WORDS = {"large": ("large", "big"), "small": ("small", "little")}
KIND_WORDS = {
    "circle": ("circle", "disc"),
    "square": ("square",),
    "triangle": ("triangle",),
    "diamond": ("diamond", "rhombus"),
    "star": ("star",),
    "cross": ("cross", "plus sign"),
}
CELL_WORDS = {
    (0, 0): ("top left", "upper left"),
    (0, 1): ("top center", "top middle"),
    (0, 2): ("top right", "upper right"),
    (1, 0): ("middle left", "center left"),
    (1, 1): ("center", "middle"),
    (1, 2): ("middle right", "center right"),
    (2, 0): ("bottom left", "lower left"),
    (2, 1): ("bottom center", "bottom middle"),
    (2, 2): ("bottom right", "lower right"),
}
NUM_SHAPES_WEIGHTS = (0.2, 0.4, 0.4)  # 1, 2 or 3 shapes: multi-shape images make captions near-unique
LONG_SHAPES = (6, 7, 8, 9)
"""Long captions: the shapes of an image, drawn evenly (of its 9 cells)."""
COUNT_WORDS = {6: "six", 7: "seven", 8: "eight", 9: "nine"}
MASK_CLASSES = ("background", *KINDS)
"""A mask pixel's value indexes this: 0 the background, then the shape kinds."""
DENSE_FILE, DENSE_CLASSES_FILE = "dense.jsonl", "dense_classes.json"
SUPERSAMPLE = 4
JITTER = 0.0
"""Offset range of a shape within its cell, as a fraction of the free space. Zero: every shape sits
at its cell's centre, so a position is exactly the grid cell the caption names."""


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    size: str
    cell: tuple[int, int]  # (row, col)
    jitter: tuple[float, float]  # offset of the centre within the cell, in cell fractions


def _rng(seed: int, split: str, index: int, long: bool = False) -> random.Random:
    return random.Random(f"shapes{'-long' if long else ''}/{seed}/{split}/{index}")


def sample_scene(rng: random.Random) -> list[Shape]:
    n = rng.choices((1, 2, 3), weights=NUM_SHAPES_WEIGHTS)[0]
    cells = rng.sample(sorted(CELL_WORDS), n)
    shapes = []
    for cell in cells:
        size = rng.choice(sorted(SIZES))
        slack = (1 - SIZES[size]) / 2 * JITTER
        shapes.append(
            Shape(
                kind=rng.choice(KINDS),
                color=rng.choice(sorted(COLORS)),
                size=size,
                cell=cell,
                jitter=(rng.uniform(-slack, slack), rng.uniform(-slack, slack)),
            )
        )
    return shapes


def describe(shapes: list[Shape], rng: random.Random) -> str:
    """A caption naming every shape, in an order and wording drawn from ``rng``."""
    parts = []
    for s in rng.sample(shapes, len(shapes)):
        size = rng.choice(SIZE_WORDS[s.size])
        kind = rng.choice(KIND_WORDS[s.kind])
        where = rng.choice(CELL_WORDS[s.cell])
        form = rng.randrange(3)
        if form == 0:
            parts.append(f"{_article(size)} {size} {s.color} {kind} in the {where}")
        elif form == 1:
            parts.append(f"{_article(s.color)} {s.color} {kind}, {size}, at the {where}")
        else:
            parts.append(f"in the {where} {_article(size)} {size} {s.color} {kind}")
    if len(parts) == 1:
        body = parts[0]
    else:
        joiner = rng.choice((" and ", ", ", "; "))
        body = joiner.join(parts[:-1]) + rng.choice((" and ", ", and ", " as well as ")) + parts[-1]
    prefix = rng.choice(("", "", "a picture of ", "an image with ", "there is "))
    return body if body.startswith("in the") else prefix + body


def sample_long_scene(rng: random.Random) -> list[Shape]:
    """6 to 9 shapes in distinct cells, in reading order (top row first, each row left to right)."""
    cells = sorted(rng.sample(sorted(CELL_WORDS), rng.choice(LONG_SHAPES)))
    return [Shape(kind=rng.choice(KINDS), color=rng.choice(sorted(COLORS)), size=rng.choice(sorted(SIZES)),
                  cell=cell, jitter=(0.0, 0.0)) for cell in cells]


def describe_long(shapes: list[Shape], rng: random.Random) -> str:
    """A caption that counts the shapes and then names each, in the order given (reading order), a
    clause each in a wording drawn from ``rng``."""
    clauses = []
    for s in shapes:
        size, kind, where = rng.choice(SIZE_WORDS[s.size]), rng.choice(KIND_WORDS[s.kind]), rng.choice(CELL_WORDS[s.cell])
        thing = f"{_article(size)} {size} {s.color} {kind}"
        form = rng.randrange(3)
        clauses.append(f"in the {where} there is {thing}" if form == 0 else
                       f"{thing} sits in the {where}" if form == 1 else f"the {where} holds {thing}")
    opening = rng.choice(("a picture of", "an image with", "a dark grid holding"))
    body = "; ".join(clauses[:-1]) + rng.choice(("; and ", ", and finally ", "; last, ")) + clauses[-1]
    return f"{opening} {COUNT_WORDS[len(shapes)]} shapes, from the top row down: {body}"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def render(shapes: list[Shape], image_size: int, rng: random.Random) -> Image.Image:
    big = image_size * SUPERSAMPLE
    shade = rng.randint(20, 60)
    img = Image.new("RGB", (big, big), (shade, shade, shade + rng.randint(0, 15)))
    draw = ImageDraw.Draw(img)
    for s in shapes:
        for op, points in _outline(s, big):
            fill = COLORS[s.color]
            if op == "ellipse":
                draw.ellipse(points, fill=fill)
            elif op == "rectangle":
                draw.rectangle(points, fill=fill)
            else:
                draw.polygon(points, fill=fill)
    return img.resize((image_size, image_size), Image.Resampling.BOX)


def render_mask(shapes: list[Shape], image_size: int) -> Image.Image:
    """The class of each pixel of :func:`render`'s image (mode L, :data:`MASK_CLASSES` indices): the
    same outlines drawn at the same supersampled size with the class as fill, then each pixel the
    class at its centre (nearest), where the image averages its samples (box)."""
    big = image_size * SUPERSAMPLE
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    for s in shapes:
        fill = MASK_CLASSES.index(s.kind)
        for op, points in _outline(s, big):
            getattr(draw, op)(points, fill=fill)
    return mask.resize((image_size, image_size), Image.Resampling.NEAREST)


def _outline(s: Shape, side: float) -> list[tuple[str, list]]:
    """What draws shape ``s`` on an image of ``side`` pixels: (ellipse | rectangle | polygon, its
    points), the one geometry its picture and its box are both made from."""
    cell = side / 3
    cx = (s.cell[1] + 0.5 + s.jitter[0]) * cell
    cy = (s.cell[0] + 0.5 + s.jitter[1]) * cell
    r = SIZES[s.size] * cell / 2
    if s.kind == "circle":
        return [("ellipse", [(cx - r, cy - r), (cx + r, cy + r)])]
    if s.kind == "square":
        q = r * 0.85
        return [("rectangle", [(cx - q, cy - q), (cx + q, cy + q)])]
    if s.kind == "triangle":
        return [("polygon", [(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)])]
    if s.kind == "diamond":
        return [("polygon", [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)])]
    if s.kind == "star":
        radii = [r if i % 2 == 0 else r * 0.45 for i in range(10)]
        angles = [-math.pi / 2 + i * math.pi / 5 for i in range(10)]
        return [("polygon", [(cx + a * math.cos(t), cy + a * math.sin(t)) for a, t in zip(radii, angles)])]
    if s.kind == "cross":
        w = r * 0.36
        return [("rectangle", [(cx - r, cy - w), (cx + r, cy + w)]), ("rectangle", [(cx - w, cy - r), (cx + w, cy + r)])]
    raise ValueError(s.kind)  # pragma: no cover - KINDS is closed


def regions(shapes: list[Shape], image_size: int) -> list[dict]:
    """Each shape's box (pixels of the ``image_size`` image, its outline's extent) and a phrase that
    refers to it alone in its image: size, colour and kind ("the large orange triangle"), and its
    cell as well where another shape of the image shares those."""
    out = []
    for s in shapes:
        points = [p for _, pts in _outline(s, image_size) for p in pts]
        xs, ys = [x for x, _ in points], [y for _, y in points]
        phrase = f"the {SIZE_WORDS[s.size][0]} {s.color} {KIND_WORDS[s.kind][0]}"
        if sum((t.size, t.color, t.kind) == (s.size, s.color, s.kind) for t in shapes) > 1:
            phrase += f" in the {CELL_WORDS[s.cell][0]}"
        box = [max(0.0, min(xs)), max(0.0, min(ys)), min(image_size, max(xs)), min(image_size, max(ys))]
        out.append({"box": [round(v, 2) for v in box], "text": phrase})
    return out


def _make_rows(job: tuple[str, int, int, int, tuple[float, float], int, str, bool, bool, bool]) -> list[dict]:
    """One draw per row picks its modality: text-only below the text-only fraction, image-only in the
    next ``image_only_fraction``, image-text above (so a fraction of 0 leaves the other rows as they were).
    The regions and masks draw nothing: with them, the rows are the same rows, and their images the same images;
    a row's mask (``with_masks``) is written beside its image and named in the row as ``mask``."""
    split, start, stop, seed, (text_only, image_only), image_size, out, with_regions, long, with_masks = job
    rows = []
    for i in range(start, stop):
        rng = _rng(seed, split, i, long)
        shapes = (sample_long_scene if long else sample_scene)(rng)
        text = (describe_long if long else describe)(shapes, rng)
        key = f"shapes-{split}-{i:06d}"
        row: dict = {"id": key}
        draw = rng.random()
        if draw >= text_only:
            rel = f"images/{split}/{i:06d}.png"
            render(shapes, image_size, rng).save(os.path.join(out, rel), optimize=False, compress_level=1)
            row["image"] = rel
            if with_regions:
                row["regions"] = regions(shapes, image_size)
            if with_masks:
                row["mask"] = f"masks/{split}/{i:06d}.png"
                render_mask(shapes, image_size).save(os.path.join(out, row["mask"]), optimize=False, compress_level=1)
        if not text_only <= draw < text_only + image_only:
            row["text"] = text
        rows.append(row)
    return rows


def _write_split(out: Path, split: str, num: int, seed: int, frac: tuple[float, float], image_size: int,
                 workers: int, with_regions: bool = False, long: bool = False, with_masks: bool = False) -> Path:
    (out / "images" / split).mkdir(parents=True, exist_ok=True)
    if with_masks:
        (out / "masks" / split).mkdir(parents=True, exist_ok=True)
    chunk = 500
    jobs = [(split, s, min(s + chunk, num), seed, frac, image_size, str(out), with_regions, long, with_masks)
            for s in range(0, num, chunk)]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as ex:
            parts = list(ex.map(_make_rows, jobs))
    else:
        parts = [_make_rows(j) for j in jobs]
    path = out / f"{split}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for rows in parts:
            for row in rows:
                f.write(json.dumps({k: v for k, v in row.items() if k != "mask"}) + "\n")
    os.replace(tmp, path)
    if with_masks:
        _write_dense(out, [row for rows in parts for row in rows])
    return path


def _write_dense(out: Path, rows: list[dict]) -> None:
    """``out/dense.jsonl`` ({"image", "mask"} a row, both relative to ``out``) and ``out/dense_classes.json``."""
    lines = "".join(json.dumps({"image": r["image"], "mask": r["mask"]}) + "\n" for r in rows)
    (out / DENSE_FILE).write_text(lines)
    (out / DENSE_CLASSES_FILE).write_text(json.dumps(list(MASK_CLASSES)) + "\n")


def synthesize(
    out: str | Path,
    num: int,
    val: int,
    text_only_fraction: float = 0.0,
    seed: int = 0,
    image_size: int = 48,
    workers: int = 0,
    image_only_fraction: float = 0.0,
    with_regions: bool = False,
    long_captions: bool = False,
    with_masks: bool = False,
) -> dict[str, Path]:
    """Write ``out/train.jsonl`` (num rows), ``out/val.jsonl`` (val image-text rows) and their images;
    ``with_regions``: each row with an image also lists its shapes' boxes and phrases (:func:`regions`);
    ``long_captions``: images of 6 to 9 shapes with captions naming them all (:func:`describe_long`);
    ``with_masks``: each val image's segmentation mask, listed in ``out/dense.jsonl`` (:func:`render_mask`).

    The same arguments always write the same files. Validation rows are all image-text pairs,
    drawn from their own random stream, so the training fractions of text-only and image-only
    rows do not change them.
    """
    if num < 0 or val < 0:
        raise UserError(f"--num and --val must be >= 0, got {num} and {val}")
    if not 0.0 <= text_only_fraction < 1.0:
        raise UserError(f"--text-only-fraction must be in [0, 1), got {text_only_fraction}")
    if not 0.0 <= image_only_fraction < 1.0 - text_only_fraction:
        raise UserError(f"--image-only-fraction must be >= 0 and leave some image-text rows beside "
                        f"--text-only-fraction {text_only_fraction}, got {image_only_fraction}")
    if image_size < 12:
        raise UserError(f"--image-size must be >= 12, got {image_size}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    workers = workers or min(usable_cpus(), 8)
    paths = {"train": _write_split(out, "train", num, seed, (text_only_fraction, image_only_fraction), image_size,
                                   workers, with_regions, long_captions)}
    paths["val"] = _write_split(out, "val", val, seed, (0.0, 0.0), image_size, workers, with_regions, long_captions,
                                with_masks)
    return paths


CLASSIFY_TEMPLATES = (
    "a {}",
    "a large {}",
    "a small {}",
    "there is a {}",
    "a picture of a {}",
    "an image with a {}",
)
"""Prompts in the captions' own wording, written beside a classify set as templates.txt."""


def _classify_image(job: tuple[str, int, int, int, str]) -> None:
    kind, i, seed, image_size, path = job
    rng = random.Random(f"shapes-classify/{seed}/{kind}/{i}")
    shape = Shape(kind=kind, color=rng.choice(sorted(COLORS)), size=rng.choice(sorted(SIZES)),
                  cell=rng.choice(sorted(CELL_WORDS)), jitter=(0.0, 0.0))
    render([shape], image_size, rng).save(path, optimize=False, compress_level=1)


def synthesize_classify(out: str | Path, per_class: int, seed: int = 0, image_size: int = 48, workers: int = 0) -> Path:
    """Write ``out/KIND/NNNN.png``: one shape per image (random colour, size and cell), one folder per
    shape kind, a zero-shot classification set; and ``out/templates.txt``."""
    if per_class < 1:
        raise UserError(f"--per-class must be >= 1, got {per_class}")
    if image_size < 12:
        raise UserError(f"--image-size must be >= 12, got {image_size}")
    out = Path(out)
    jobs = []
    for kind in KINDS:
        (out / kind).mkdir(parents=True, exist_ok=True)
        jobs += [(kind, i, seed, image_size, str(out / kind / f"{i:04d}.png")) for i in range(per_class)]
    workers = workers or min(usable_cpus(), 8)
    if workers > 1 and len(jobs) > 200:
        with ProcessPoolExecutor(workers) as ex:
            list(ex.map(_classify_image, jobs, chunksize=64))
    else:
        for job in jobs:
            _classify_image(job)
    (out / "templates.txt").write_text("\n".join(CLASSIFY_TEMPLATES) + "\n")
    return out


TOKENIZER_VOCAB = 512


def write_tokenizer(out: str | Path, vocab_size: int = TOKENIZER_VOCAB) -> Path:
    """``out/tokenizer.json``: a BPE tokenizer trained on ``out/train.jsonl``'s captions (kept if there)."""
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    path = Path(out) / "tokenizer.json"
    if not path.exists():
        train_tokenizer(source_texts([str(Path(out) / "train.jsonl")]), path, vocab_size=vocab_size)
    return path
