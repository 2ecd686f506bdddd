"""Image-text retrieval where an image may have several captions (COCO, Flickr30k: five each), and
ITM re-ranking of the top candidates for fusion models.

The protocol (as CLIP, ALBEF and BLIP report it):

- **image -> text**: each image is a query over all captions; it counts at k when one of *its*
  captions is among the k best. ``i2t_rK`` is the fraction of images.
- **text -> image**: each caption is a query over all images; it counts at k when *its one* image
  is among the k best. ``t2i_rK`` is the fraction of captions.
- A tie counts against: a query's rank is the number of wrong candidates scoring at least as high
  as its best right one, so a collapsed model scores 0.

**ITM re-ranking** (``eval.itm_rerank_k``, fusion models): each query's top k candidates by
embedding similarity are scored again by the ITM head on the fused pair (the log-odds of a match)
and put first in that order; candidates past k keep their embedding order. Recall at k above the
re-ranking depth is therefore unchanged. The pairs of both directions are split over the ranks,
scored in batches through the wrapped task's ``itm`` part (every rank runs the same number of
forwards) and gathered; the candidates and scores stay on the device (no per-query host round
trip). Every rank keeps every image's and caption's tokens for it, as ALBEF's evaluation does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vltrain.data.config import DataConfig
from vltrain.data.loading.loader import EvalLoader, build_eval_loader
from vltrain.data.tokenizers import Tokenizer
from vltrain.eval.captions import open_captions
from vltrain.eval.embedding import Embedded, Encoder, embed_gathered, eval_mode, text_loader
from vltrain.eval.labeled import ImageListDataset
from vltrain.model.passes import ItmLogits
from vltrain.runtime.distributed import all_gather_no_grad, world_info

KS = (1, 5, 10)
RERANKED = 1e4
"""Added to a re-ranked candidate's ITM score: above any cosine similarity."""


def query_ranks(queries: torch.Tensor, keys: torch.Tensor, positive, rescored=None, chunk: int = 1024) -> torch.Tensor:
    """int64 [Q]: per query, the wrong keys scoring at least as high as its best right key.

    ``positive(lo, hi)`` is the bool [hi - lo, K] mask of right keys of queries lo:hi;
    ``rescored`` = (index [Q, k], score [Q, k]) replaces those keys' scores (re-ranking)."""
    ranks = []
    keys = keys.float()
    for lo in range(0, queries.shape[0], chunk):
        hi = min(lo + chunk, queries.shape[0])
        scores = queries[lo:hi].float() @ keys.T
        if rescored is not None:
            scores.scatter_(1, rescored[0][lo:hi], RERANKED + rescored[1][lo:hi].float())
        pos = positive(lo, hi)
        best = scores.masked_fill(~pos, float("-inf")).max(dim=1, keepdim=True).values
        ranks.append(((scores >= best) & ~pos).sum(dim=1))
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long)


def multi_caption_recall(image_embeds: torch.Tensor, text_embeds: torch.Tensor, image_of: torch.Tensor,
                         rescored: tuple | None = None, prefix: str = "") -> dict[str, float]:
    """``i2t_r1 .. t2i_r10`` and ``mean_recall`` under the protocol above; ``rescored`` =
    (image->text, text->image) re-ranked candidates and scores."""
    image_of = image_of.to(text_embeds.device)
    images = torch.arange(image_embeds.shape[0], device=image_embeds.device)
    i2t = query_ranks(image_embeds, text_embeds, lambda lo, hi: image_of[None, :] == images[lo:hi, None],
                      rescored[0] if rescored else None)
    t2i = query_ranks(text_embeds, image_embeds, lambda lo, hi: images[None, :] == image_of[lo:hi, None],
                      rescored[1] if rescored else None)
    out = {}
    for name, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in KS:
            out[f"{prefix}{name}_r{k}"] = float((ranks < k).float().mean()) if ranks.numel() else 0.0
    out[f"{prefix}mean_recall"] = sum(out[f"{prefix}{d}_r{k}"] for d in ("i2t", "t2i") for k in KS) / (2 * len(KS))
    return out


def top_candidates(queries: torch.Tensor, keys: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """int64 [Q, min(k, K)]: each query's best keys by embedding similarity."""
    k = min(k, keys.shape[0])
    parts = [(queries[lo: lo + chunk].float() @ keys.float().T).topk(k, dim=1).indices
             for lo in range(0, queries.shape[0], chunk)]
    return torch.cat(parts)


@torch.no_grad()
def itm_scores(wrapped: nn.Module, pair_image: torch.Tensor, pair_text: torch.Tensor, images: Embedded,
               texts: Embedded, batch_size: int, autocast) -> torch.Tensor:
    """float32 [P]: the ITM log-odds of a match of each (image, caption) pair, on every rank.

    Each rank scores a contiguous share of the pairs in the same number of batches (a rank whose
    share has run out scores one repeated pair), then the scores are gathered in pair order."""
    rank, world = world_info()
    n = pair_image.shape[0]
    lo, hi = rank * n // world, (rank + 1) * n // world
    longest = -(-n // world)
    steps = max(1, -(-longest // batch_size))
    out = []
    for s in range(steps):
        a, b = lo + s * batch_size, min(lo + (s + 1) * batch_size, hi)
        idx = torch.arange(a, b, device=pair_image.device) if b > a else pair_image.new_tensor([max(hi - 1, 0)])
        img, txt = pair_image[idx], pair_text[idx]
        mask = texts.mask[txt]
        width = max(int(mask.sum(dim=1).max()), 1)  # one host sync per batch: drop all-padding columns
        with autocast():
            logits = wrapped(ItmLogits(texts.tokens[txt, :width], mask[:, :width], images.tokens[img]))
        out.append((logits[:, 1] - logits[:, 0]).float()[: max(b - a, 0)])
    return all_gather_no_grad(torch.cat(out))


def itm_rerank(wrapped: nn.Module, images: Embedded, texts: Embedded, k: int, batch_size: int, autocast):
    """(image->text, text->image) re-ranked candidates: each (index [Q, k], ITM score [Q, k])."""
    i2t = top_candidates(images.embeds, texts.embeds, k)
    t2i = top_candidates(texts.embeds, images.embeds, k)
    dev = i2t.device
    n_img, n_txt = images.embeds.shape[0], texts.embeds.shape[0]
    pair_image = torch.cat([torch.arange(n_img, device=dev).repeat_interleave(i2t.shape[1]), t2i.flatten()])
    pair_text = torch.cat([i2t.flatten(), torch.arange(n_txt, device=dev).repeat_interleave(t2i.shape[1])])
    with eval_mode(wrapped):
        scores = itm_scores(wrapped, pair_image, pair_text, images, texts, batch_size, autocast)
    split = i2t.numel()
    return (i2t, scores[:split].view_as(i2t)), (t2i, scores[split:].view_as(t2i))


def recall_with_rerank(wrapped: nn.Module, images: Embedded, texts: Embedded, image_of: torch.Tensor,
                       rerank_k: int, batch_size: int, autocast, prefix: str = "") -> dict[str, float]:
    """Embedding recalls, and with ``rerank_k`` the re-ranked ones as ``itm_i2t_r1`` ..."""
    out = multi_caption_recall(images.embeds, texts.embeds, image_of, prefix=prefix)
    if rerank_k:
        rescored = itm_rerank(wrapped, images, texts, rerank_k, batch_size, autocast)
        out.update(multi_caption_recall(images.embeds, texts.embeds, image_of, rescored, prefix=f"{prefix}itm_"))
    return out


@dataclass
class RetrievalTask:
    """One caption set, opened once: which image each caption describes, with this rank's loaders."""

    name: str
    image_of: torch.Tensor
    images: EvalLoader
    captions: EvalLoader


def open_retrieval(name: str, path: str, split: str, image_root: str, data_cfg: DataConfig, tokenizer: Tokenizer, *,
                   rank: int, world_size: int, batch_size: int) -> RetrievalTask:
    sets = open_captions(path, split, image_root)
    images = build_eval_loader(data_cfg, ImageListDataset(sets.images, data_cfg), rank=rank,
                               world_size=world_size, batch_size=batch_size, pad_id=tokenizer.pad_id)
    captions = text_loader(sets.captions, tokenizer, data_cfg, rank, world_size, batch_size)
    return RetrievalTask(name, torch.tensor(sets.image_of), images, captions)


def evaluate_retrieval(encoder: Encoder, task: RetrievalTask, rerank_k: int, batch_size: int) -> dict[str, float]:
    """``retrieval/NAME/i2t_r1`` ... on every rank. An unreadable image is left out with its captions."""
    keep = bool(rerank_k)
    images = embed_gathered(encoder, task.images, "image", keep_tokens=keep)
    texts = embed_gathered(encoder, task.captions, "text", keep_tokens=keep)
    image_of = task.image_of.to(images.embeds.device)
    readable = images.present
    unreadable = int((~readable).sum())
    if unreadable:
        renumber = torch.cumsum(readable.long(), 0) - 1
        captions = readable[image_of]
        images = Embedded(images.embeds[readable], readable[readable],
                          None if images.tokens is None else images.tokens[readable])
        texts = Embedded(texts.embeds[captions], texts.present[captions],
                         None if texts.tokens is None else texts.tokens[captions],
                         None if texts.mask is None else texts.mask[captions])
        image_of = renumber[image_of[captions]]
    prefix = f"retrieval/{task.name}/"
    out = recall_with_rerank(encoder.wrapped, images, texts, image_of, rerank_k, batch_size, encoder.autocast, prefix)
    out.update({f"{prefix}num_images": images.embeds.shape[0], f"{prefix}num_captions": texts.embeds.shape[0],
                f"{prefix}num_unreadable": unreadable})
    return out
