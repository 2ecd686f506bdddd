"""Grounding with a LocCa decoder (:mod:`vltrain.model.locca`): the box a phrase names in an image
(``vltrain ground``), the phrase a box holds (``vltrain caption --boxes``), and referring-expression
metrics (``eval.referring``, ``vltrain eval --referring FILE``): Acc@0.5, the share of boxes
whose IoU with the true one is at least 0.5, as RefCOCO reports it, and the mean IoU.

Each (image, phrase) pair goes through :func:`vltrain.data.loading.loader.build_eval_loader` as an
image with the phrase as its text: each rank reads a contiguous slice, decoded as in training, and
the boxes are gathered in list order. The decoder writes a box in [0, 1] of the image as the model
sees it; :func:`to_image_pixels` maps it back to the image's pixels as shown (through the center
crop of ``data.resize: crop``; squash and native see the whole image).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from vltrain.boxes import box_iou
from vltrain.data.config import DataConfig
from vltrain.data.dataset import Sample
from vltrain.data.images import shown_size, shown_window
from vltrain.data.loading.loader import build_eval_loader
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import UserError
from vltrain.eval.captioning import Generating, gather_token_rows, locca_vocab, open_to_generate
from vltrain.eval.embedding import Encoder, eval_mode
from vltrain.eval.labeled import ImageListDataset
from vltrain.model.locca import describe, ground
from vltrain.model.passes import Encode
from vltrain.runtime.distributed import all_gather_no_grad


class PairDataset(ImageListDataset):
    """``ds[i]``: image file ``images[i]`` decoded as in training, with ``texts[i]`` as its text."""

    def __init__(self, images: list[str], texts: list[str], cfg: DataConfig, tokenizer: Tokenizer):
        super().__init__(images, cfg)
        self.texts, self.tokenizer = texts, tokenizer

    def __getitem__(self, i: int) -> Sample:
        sample = super().__getitem__(i)
        sample.input_ids, sample.truncated = self.tokenizer.encode(self.texts[i], self.cfg.max_text_length)
        return sample


def view_window(path: str, resize: str) -> tuple[float, float, float, float]:
    """The part (x0, y0, x1, y1, in pixels of the image as shown) that the model sees of image
    ``path``: the center square ``data.resize: crop`` keeps, else the whole image (read from its header)."""
    with Image.open(path) as im:
        height, width = shown_size(im)
    return shown_window(width, height, resize)


def to_image_pixels(boxes: torch.Tensor, windows: list[tuple[float, float, float, float]]) -> torch.Tensor:
    """``boxes`` [n, 4] in [0, 1] of what the model saw, in pixels of each image as shown."""
    w = torch.tensor(windows, dtype=torch.float32).reshape(-1, 4)
    size = torch.cat([w[:, 2:] - w[:, :2]] * 2, dim=1)
    return w[:, :2].repeat(1, 2) + boxes.float() * size


def from_image_pixels(boxes: torch.Tensor, windows: list[tuple[float, float, float, float]]) -> torch.Tensor:
    """The inverse of :func:`to_image_pixels`, clipped to [0, 1]."""
    w = torch.tensor(windows, dtype=torch.float32).reshape(-1, 4)
    size = torch.cat([w[:, 2:] - w[:, :2]] * 2, dim=1)
    return ((boxes.float() - w[:, :2].repeat(1, 2)) / size).clamp(0, 1)


@dataclass
class Grounded:
    """Every pair's box in [0, 1] of what the model saw, in list order, and which images could be read."""

    boxes: torch.Tensor
    present: list[bool]
    errors: list[tuple[str, str]]


@torch.no_grad()
def ground_pairs(encoder: Encoder, tokenizer: Tokenizer, images: list[str], texts: list[str], *, rank: int,
                 world_size: int, batch_size: int) -> Grounded:
    """The box the decoder writes for each (image, phrase) pair, gathered from every rank."""
    cfg, model = encoder.data_cfg, encoder.wrapped
    vocab = _vocab(model)
    tasks = getattr(getattr(model, "objectives", None), "locca", None)
    parallel = tasks is not None and tasks.parallel >= 1  # decoded as it trained: it never trained causally
    loader = build_eval_loader(cfg, PairDataset(images, texts, cfg, tokenizer), rank=rank, world_size=world_size,
                               batch_size=batch_size, pad_id=tokenizer.pad_id)
    boxes, present, errors = [], [], {}
    with eval_mode(model):
        for batch in loader:
            inputs = batch.to_model_inputs(encoder.device, cfg.mean, cfg.std)
            with encoder.autocast():
                tokens = model(Encode(inputs)).image_tokens
                boxes.append(ground(model, vocab, tokens, inputs.input_ids, inputs.attention_mask.sum(dim=1),
                                    tokenizer.pad_id, parallel).float())
            present += inputs.has_image.tolist()
            errors.update(dict(batch.errors))
    n = loader.num_samples
    local = torch.cat(boxes)[:n] if boxes else torch.zeros(0, 4, device=encoder.device)
    seen = torch.tensor(present[:n], dtype=torch.bool, device=encoder.device)
    return Grounded(all_gather_no_grad(local).cpu(), all_gather_no_grad(seen).tolist(), list(errors.items()))


@torch.no_grad()
def describe_boxes(encoder: Encoder, tokenizer: Tokenizer, images: list[str], boxes: torch.Tensor, max_tokens: int,
                   *, rank: int, world_size: int, batch_size: int) -> tuple[list[list[int]], list[bool]]:
    """The phrase (token ids) the decoder writes for each image's box ``boxes`` [n, 4] (in [0, 1] of
    what the model sees), gathered from every rank in list order, and which images could be read."""
    cfg, model = encoder.data_cfg, encoder.wrapped
    vocab = _vocab(model)
    loader = build_eval_loader(cfg, PairDataset(images, [""] * len(images), cfg, tokenizer), rank=rank,
                               world_size=world_size, batch_size=batch_size, pad_id=tokenizer.pad_id)
    rows, present = [], []
    with eval_mode(model):
        for batch in loader:
            inputs = batch.to_model_inputs(encoder.device, cfg.mean, cfg.std)
            index = loader.offset + len(rows) + torch.arange(len(inputs))
            with encoder.autocast():
                tokens = model(Encode(inputs)).image_tokens
                rows += describe(model, vocab, tokens, boxes[index.clamp(max=len(boxes) - 1)].to(encoder.device),
                                 max_tokens, tokenizer.eos_id, tokenizer.pad_id)
            present += inputs.has_image.tolist()
    return gather_token_rows(rows, present, loader.num_samples, encoder.device)


def _vocab(model):
    """The LocCa decoder's vocabulary of ``model`` (bare, or the task that wraps it)."""
    vocab = locca_vocab(model)
    if vocab is None:
        raise UserError("grounding needs a LocCa decoder: train a preset with one (tiny-siglip2, siglip2-vit-b16) "
                        "with model.loss.referring > 0")
    return vocab


@dataclass
class ReferringSet:
    """A referring-expression set: each row an image, a phrase and its true box (pixels as shown)."""

    name: str
    images: list[str]
    texts: list[str]
    boxes: torch.Tensor


def open_referring(name: str, path: str | Path, image_root: str | Path = "") -> ReferringSet:
    """JSON lines ``{"image": PATH, "text": PHRASE, "box": [x0, y0, x1, y1]}``, the box in pixels of
    the image as shown, the image relative to ``image_root`` (empty: the file's folder)."""
    p = Path(path)
    root = Path(image_root) if image_root else p.parent
    images, texts, boxes = [], [], []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"eval.referring {name}: cannot read {p} ({e.strerror or e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            box = [float(v) for v in row["box"]]
            image, text = str(row["image"]), str(row["text"]).strip()
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{p}:{n}: a referring row is {{\"image\", \"text\", \"box\": [x0, y0, x1, y1]}} ({e})") from None
        if len(box) != 4 or not (box[0] < box[2] and box[1] < box[3]) or not text:
            raise UserError(f"{p}:{n}: the box must be 4 numbers with x0 < x1 and y0 < y1, and the text non-empty; "
                            f"got box {row['box']} text {row['text']!r}")
        images.append(str(root / image))
        texts.append(text)
        boxes.append(box)
    if not images:
        raise UserError(f"{p}: no referring rows")
    return ReferringSet(name, images, texts, torch.tensor(boxes, dtype=torch.float32))


def referring_scores(predicted: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """acc50 (the share of IoU >= 0.5) and miou of boxes [n, 4] against the true ones."""
    iou = box_iou(predicted, truth)
    return {"acc50": float((iou >= 0.5).float().mean()), "miou": float(iou.mean())}


def evaluate_referring(encoder: Encoder, tokenizer: Tokenizer, task: ReferringSet, *, rank: int, world_size: int,
                       batch_size: int) -> dict[str, float]:
    """``referring/NAME/acc50``, ``miou`` and ``num_pairs`` (an unreadable image is left out), on every rank."""
    found = ground_pairs(encoder, tokenizer, task.images, task.texts, rank=rank, world_size=world_size,
                         batch_size=batch_size)
    keep = [i for i, ok in enumerate(found.present) if ok]
    if not keep:
        raise UserError(f"eval.referring {task.name}: none of its {len(task.images)} images could be read "
                        f"(first: {found.errors[0][0] if found.errors else '?'}); check image_root")
    windows = [view_window(task.images[i], encoder.data_cfg.resize) for i in keep]
    pixels = to_image_pixels(found.boxes[keep], windows)
    prefix = f"referring/{task.name}/"
    out = {prefix + k: v for k, v in referring_scores(pixels, task.boxes[keep]).items()}
    return out | {f"{prefix}num_pairs": len(keep), f"{prefix}num_unreadable": len(task.images) - len(keep)}


def _open_for(path: Path, overrides: list[str]) -> Generating:
    """The LocCa model at ``path`` opened to generate (one line, and the world closed, without one)."""
    from vltrain.checkpoint.paths import locate
    from vltrain.compose.decide import model_config

    g = open_to_generate(model_config(locate(path), overrides, purpose="caption"))
    try:
        _vocab(g.model)
    except BaseException:
        g.world.close(False)
        raise
    return g


def ground_images(path: Path, images: list[str], texts: list[str], overrides: list[str], *, batch_size: int = 32
                  ) -> list[tuple[str, str, list[float] | None]]:
    """``vltrain ground``: (image, text, box in pixels of the image as shown, or None where the image
    could not be read) of each pair, in order, on every rank."""
    o = _open_for(path, overrides)
    clean = False
    try:
        w = o.world
        found = ground_pairs(o.encoder, o.tokenizer, images, texts, rank=w.rank, world_size=w.world_size,
                             batch_size=batch_size)
        out = []
        for i, (image, text) in enumerate(zip(images, texts)):
            box = None
            if found.present[i]:
                box = to_image_pixels(found.boxes[i:i + 1], [view_window(image, o.encoder.data_cfg.resize)])[0]
                box = [round(v, 1) for v in box.tolist()]
            out.append((image, text, box))
        clean = True
        return out
    finally:
        o.world.close(clean)


def caption_boxes(path: Path, images: list[str], boxes: list[list[float]], overrides: list[str], *,
                  max_length: int = 0, batch_size: int = 32) -> list[tuple[str, str | None]]:
    """``vltrain caption --boxes``: (image, the phrase the decoder writes for its box, given in pixels
    of the image as shown; None where the image could not be read), in order, on every rank."""
    o = _open_for(path, overrides)
    clean = False
    try:
        w, cfg = o.world, o.encoder.data_cfg
        windows = []
        for image in images:
            try:
                windows.append(view_window(image, cfg.resize))
            except OSError:
                windows.append((0.0, 0.0, 1.0, 1.0))  # unreadable: the loader says so and it gets no phrase
        seen = from_image_pixels(torch.tensor(boxes, dtype=torch.float32), windows)
        ids, present = describe_boxes(o.encoder, o.tokenizer, images, seen, max_length or cfg.max_text_length,
                                      rank=w.rank, world_size=w.world_size, batch_size=batch_size)
        clean = True
        return [(image, o.tokenizer.decode(t).strip() if ok else None) for image, t, ok in zip(images, ids, present)]
    finally:
        o.world.close(clean)
