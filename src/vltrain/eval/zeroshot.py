"""Zero-shot classification: a labelled image set scored against prompted class names.

Each class name is put into every prompt template; the class embedding is the normalized mean of
its prompts' text embeddings (each distinct prompt encoded once per evaluation). An image's
prediction is the class whose embedding is most similar to its own.

Distribution: the prompts and the images are each split over the ranks (every rank runs the same
number of batches). The prompt embeddings are gathered, so every rank holds the same class
embeddings; each rank scores its own images and the per-class counts are summed in one
all-reduce. The result is exact whatever the world size, and no rank waits idle.

An image that cannot be read is reported (``vltrain`` log, its rank's) and counted in
``num_unreadable``; it is left out of the accuracies, and the evaluation completes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vltrain.data.config import DataConfig
from vltrain.data.loading.loader import EvalLoader, build_eval_loader
from vltrain.data.tokenizers import Tokenizer
from vltrain.eval.embedding import Encoder, embed_gathered, embed_list, eval_mode, text_loader
from vltrain.eval.labeled import ImageListDataset, open_labeled, read_templates
from vltrain.runtime.distributed import all_reduce_sum

log = logging.getLogger(__name__)

TOP_K = 5


@dataclass
class ZeroShotTask:
    """One labelled set, opened once: its images, labels and prompts, with this rank's loaders."""

    name: str
    classnames: list[str]
    labels: torch.Tensor
    """int64 [N], every image's class."""
    prompt_index: torch.Tensor
    """int64 [C, T]: class c's prompt t is distinct prompt ``prompt_index[c, t]``."""
    images: EvalLoader
    prompts: EvalLoader


def open_zeroshot(name: str, path: str, templates: str, data_cfg: DataConfig, tokenizer: Tokenizer, *,
                  rank: int, world_size: int, batch_size: int) -> ZeroShotTask:
    labeled = open_labeled(path)
    prompts: dict[str, int] = {}
    index = [[prompts.setdefault(t.replace("{}", c), len(prompts)) for t in read_templates(templates)]
             for c in labeled.classnames]
    images = build_eval_loader(data_cfg, ImageListDataset(labeled.images, data_cfg), rank=rank,
                               world_size=world_size, batch_size=batch_size, pad_id=tokenizer.pad_id)
    texts = text_loader(list(prompts), tokenizer, data_cfg, rank, world_size, batch_size)
    return ZeroShotTask(name, labeled.classnames, torch.tensor(labeled.labels), torch.tensor(index), images, texts)


def class_embeddings(prompt_embeds: torch.Tensor, prompt_index: torch.Tensor) -> torch.Tensor:
    """[C, D]: each class's prompt embeddings averaged, then normalized."""
    return F.normalize(prompt_embeds[prompt_index.to(prompt_embeds.device)].mean(dim=1), dim=-1)


def class_counts(image_embeds: torch.Tensor, labels: torch.Tensor, classes: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """float64 [3, C]: per class, images, top-1 hits and top-k hits."""
    c = classes.shape[0]
    labels = labels.to(image_embeds.device)
    topk = (image_embeds.float() @ classes.float().T).topk(min(k, c), dim=1).indices
    hit1 = (topk[:, 0] == labels).double()
    hitk = (topk == labels[:, None]).any(dim=1).double()
    counts = torch.zeros(3, c, dtype=torch.float64, device=image_embeds.device)
    for row, values in enumerate((torch.ones_like(hit1), hit1, hitk)):
        counts[row].index_add_(0, labels, values)
    return counts


def accuracy_metrics(counts: torch.Tensor, unreadable: int, prefix: str = "") -> dict[str, float]:
    """top1, top5 (of all readable images), mean_per_class (top-1 averaged over classes with images)."""
    total, hit1, hitk = counts.sum(dim=1).tolist()
    seen = counts[0] > 0
    per_class = (counts[1][seen] / counts[0][seen]).mean().item() if bool(seen.any()) else 0.0
    return {
        f"{prefix}top1": hit1 / max(total, 1),
        f"{prefix}top{TOP_K}": hitk / max(total, 1),
        f"{prefix}mean_per_class": per_class,
        f"{prefix}num_images": int(total),
        f"{prefix}num_unreadable": int(unreadable),
    }


def evaluate_zeroshot(encoder: Encoder, task: ZeroShotTask) -> dict[str, float]:
    """``zeroshot/NAME/top1`` ... on every rank (the same dict on each)."""
    prompts = embed_gathered(encoder, task.prompts, "text")
    classes = class_embeddings(prompts.embeds, task.prompt_index)
    with eval_mode(encoder.wrapped):
        local = embed_list(encoder, task.images, "image")
    offset = task.images.offset
    readable = local.present
    labels = task.labels[offset: offset + readable.shape[0]].to(encoder.device)[readable]
    counts = class_counts(local.embeds[readable], labels, classes)
    unreadable = (~readable).sum().to(torch.float64).reshape(1)
    packet = all_reduce_sum(torch.cat([counts.flatten(), unreadable]))
    for path, reason in local.errors[:5]:
        log.warning("zeroshot/%s: left out an unreadable image: %s", task.name, reason)
    if len(local.errors) > 5:
        log.warning("zeroshot/%s: %d unreadable images left out on this rank", task.name, len(local.errors))
    return accuracy_metrics(packet[:-1].view(3, -1), int(packet[-1].item()), f"zeroshot/{task.name}/")
