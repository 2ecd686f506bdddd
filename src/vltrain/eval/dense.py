"""Dense features, measured (``eval.dense``, ``vltrain eval --dense FILE``): a linear probe on the
frozen vision tower's patch tokens, scored by segmentation IoU, as SigLIP 2 reports its dense features.

A set is JSON lines ``{"image": PATH, "mask": PATH}`` (``docs/formats.md#dense-masks``): a mask is
a mode-L PNG the size of its image whose pixels are class indices, the class names listed in the
JSON file beside the set (``NAME_classes.json`` for ``NAME.jsonl``). Each image is decoded as in
training (:class:`~vltrain.eval.labeled.ImageListDataset`) and the tower's patch tokens are read;
each mask is cut to the window the model sees (:func:`~vltrain.data.images.shown_window`) and each
patch takes the class of most of its pixels (a majority over an 8 x 8 nearest sampling of the
patch). The first half of the rows (rounded down) trains a softmax regression on the standardized
patch features, full-batch L-BFGS from zeros (deterministic); the rest are scored: IoU per class
at patch level, and the mIoU over the classes that occur in the scored half's masks.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from vltrain.data.images import shown_size, shown_window
from vltrain.data.loading.loader import build_eval_loader
from vltrain.errors import ConfigError, DataError, UserError
from vltrain.eval.embedding import Encoder, eval_mode
from vltrain.eval.labeled import ImageListDataset
from vltrain.model.passes import ImageTokens
from vltrain.runtime.distributed import all_gather_no_grad

log = logging.getLogger("vltrain")

SAMPLES = 8
"""Each patch's class is the majority of SAMPLES x SAMPLES nearest samples of its mask pixels."""
PROBE_STEPS = 100
PROBE_L2 = 1e-4


@dataclass
class DenseSet:
    """A dense set: image paths, their masks (uint8 [H, W] class indices) and the class names."""

    name: str
    images: list[str]
    masks: list[torch.Tensor]
    classes: list[str]


def classes_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}_classes.json")


def _read_classes(name: str, path: Path) -> list[str]:
    f = classes_path(path)
    try:
        classes = json.loads(f.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"eval.dense {name}: cannot read {f}, the class names of {path} ({e.strerror or e}); "
                        "write a JSON list of names there, index 0 first") from None
    except ValueError as e:
        raise DataError(f"{f}: not JSON ({e}); write a JSON list of class names, index 0 first") from None
    if not isinstance(classes, list) or len(classes) < 2 or not all(isinstance(c, str) and c for c in classes):
        raise DataError(f"{f}: a JSON list of at least 2 class names, index 0 first; got {classes!r:.80}")
    return classes


def _read_mask(where: str, image: Path, mask: Path, num_classes: int) -> torch.Tensor:
    """The mask as uint8 [H, W], checked against its image's size and the class list."""
    try:
        with Image.open(image) as im:
            size = shown_size(im)
        with Image.open(mask) as m:
            if shown_size(m) != size:
                raise DataError(f"{where}: mask {mask} is {shown_size(m)[1]}x{shown_size(m)[0]} but its image "
                                f"{image} is {size[1]}x{size[0]}; a mask has its image's size")
            if m.mode not in ("L", "P", "1"):
                raise DataError(f"{where}: mask {mask} is mode {m.mode}; a mask is mode L (class indices)")
            values = torch.frombuffer(bytearray(m.convert("L").tobytes()), dtype=torch.uint8).view(m.height, m.width)
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: cannot read {e.filename if getattr(e, 'filename', None) else f'{image} or {mask}'} "
                        f"({getattr(e, 'strerror', None) or e}); check the path and image_root") from None
    top = int(values.max())
    if top >= num_classes:
        raise DataError(f"{where}: mask {mask} holds class {top}, past the {num_classes} classes of its class list")
    return values


def open_dense(name: str, path: str | Path, image_root: str | Path = "") -> DenseSet:
    """The rows of a dense set, every mask read and checked (see the module docstring)."""
    p = Path(path)
    root = Path(image_root) if image_root else p.parent
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"eval.dense {name}: cannot read {p} ({e.strerror or e})") from None
    classes = _read_classes(name, p)
    images, masks = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            image, mask = root / str(row["image"]), root / str(row["mask"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{p}:{n}: a dense row is {{\"image\": PATH, \"mask\": PATH}} ({e})") from None
        masks.append(_read_mask(f"{p}:{n}", image, mask, len(classes)))
        images.append(str(image))
    if len(images) < 2:
        raise DataError(f"{p}: {len(images)} dense rows; the probe trains on the first half and scores the rest")
    return DenseSet(name, images, masks, classes)


def patch_labels(mask: torch.Tensor, grid: int, resize: str) -> torch.Tensor:
    """int64 [grid * grid]: each patch's class, the majority of its SAMPLES^2 nearest mask samples
    within the window the model sees (ties: the lower class)."""
    height, width = mask.shape
    x0, y0, x1, y1 = (round(v) for v in shown_window(width, height, resize))
    seen = mask[y0:y1, x0:x1].float()[None, None]
    side = grid * SAMPLES
    samples = F.interpolate(seen, size=(side, side), mode="nearest")[0, 0].long()
    blocks = samples.view(grid, SAMPLES, grid, SAMPLES).permute(0, 2, 1, 3).reshape(grid * grid, -1)
    counts = F.one_hot(blocks, int(mask.max()) + 1).sum(dim=1)
    return counts.argmax(dim=1)


@torch.no_grad()
def patch_features(encoder: Encoder, model, images: list[str], *, rank: int, world_size: int,
                   batch_size: int) -> torch.Tensor:
    """float32 [n, patches, W]: the vision tower's patch tokens of each image (no class token),
    gathered from every rank in list order."""
    vision = getattr(model, "vision", None)
    if getattr(vision, "pooler", None) is not None:
        raise ConfigError("eval.dense reads the vision tower's patch tokens, which this model's attn_pool "
                          "pooling replaces with its queries; use a preset that pools with cls, mean or map")
    cfg = encoder.data_cfg
    if cfg.at_own_shape():
        raise ConfigError("eval.dense takes square-resized images: set data.resize to crop or squash")
    prefix = getattr(vision, "num_prefix", 0)
    loader = build_eval_loader(cfg, ImageListDataset(images, cfg), rank=rank, world_size=world_size,
                               batch_size=batch_size, pad_id=0)
    parts = []
    with eval_mode(encoder.wrapped):
        for batch in loader:
            if batch.errors:
                path, why = batch.errors[0]
                raise DataError(f"eval.dense: cannot read {path} ({why})")
            inputs = batch.to_model_inputs(encoder.device, cfg.mean, cfg.std)
            with encoder.autocast():
                tokens = encoder.wrapped(ImageTokens(inputs.images))
            parts.append(tokens.values[:, prefix:].float())
    local = torch.cat(parts)[:loader.num_samples]
    return all_gather_no_grad(local).cpu()


def fit_probe(x: torch.Tensor, y: torch.Tensor, num_classes: int, steps: int = PROBE_STEPS) -> torch.nn.Linear:
    """A softmax regression of ``y`` [N] on ``x`` [N, W] (already standardized): full-batch L-BFGS
    from zero weights with a small L2 penalty; no randomness, so the same features give the same probe."""
    probe = torch.nn.Linear(x.shape[1], num_classes, dtype=torch.float64)
    torch.nn.init.zeros_(probe.weight)
    torch.nn.init.zeros_(probe.bias)
    x = x.double()
    opt = torch.optim.LBFGS(probe.parameters(), lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(probe(x), y) + PROBE_L2 * probe.weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return probe


def segmentation_iou(predicted: torch.Tensor, truth: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(IoU per class [C], which classes occur in ``truth`` [C]) of label vectors."""
    hit = F.one_hot(predicted, num_classes).bool()
    want = F.one_hot(truth, num_classes).bool()
    inter = (hit & want).sum(0).double()
    union = (hit | want).sum(0).double()
    return inter / union.clamp(min=1), want.any(0)


def probe_scores(features: torch.Tensor, labels: torch.Tensor, num_classes: int, train: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``features`` [n, P, W] and ``labels`` [n, P]: a probe fit on the first ``train`` images'
    patches, scored on the rest's: :func:`segmentation_iou`."""
    x, y = features[:train].flatten(0, 1).double(), labels[:train].flatten()
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    probe = fit_probe((x - mean) / std, y, num_classes)
    with torch.no_grad():
        predicted = probe((features[train:].flatten(0, 1).double() - mean) / std).argmax(dim=1)
    return segmentation_iou(predicted, labels[train:].flatten(), num_classes)


def evaluate_dense(encoder: Encoder, model, task: DenseSet, *, rank: int, world_size: int,
                   batch_size: int) -> dict[str, float]:
    """``dense/NAME/miou``, ``iou_CLASS`` per class present, ``num_train`` and ``num_images``, on every rank."""
    features = patch_features(encoder, model, task.images, rank=rank, world_size=world_size, batch_size=batch_size)
    grid = math.isqrt(features.shape[1])
    labels = torch.stack([patch_labels(m, grid, encoder.data_cfg.resize) for m in task.masks])
    train = len(task.images) // 2
    iou, present = probe_scores(features, labels, len(task.classes), train)
    prefix = f"dense/{task.name}/"
    if int(present.sum()) < 2 and rank == 0:
        log.warning(f"dense set {task.name}: at the model's {grid} x {grid} patches every scored patch is "
                    f"{task.classes[int(present.nonzero()[0])]}, so its mIoU tells nothing; give images whose "
                    "regions span whole patches (larger images, or a model with smaller patches)")
    out = {f"{prefix}miou": float(iou[present].mean()), f"{prefix}num_classes": int(present.sum())}
    out |= {f"{prefix}iou_{c.replace(' ', '_')}": float(iou[k]) for k, c in enumerate(task.classes) if present[k]}
    return out | {f"{prefix}num_train": train, f"{prefix}num_images": len(task.images) - train}
