"""Embedding for evaluation: a list of images or texts, split over the ranks, embedded through the
wrapped task without autograd, under the training's autocast, and gathered in order.

Every list goes through :func:`vltrain.data.loading.loader.build_eval_loader`: each rank reads a contiguous
slice and every rank runs the same number of batches, so FSDP2's per-forward parameter gathers
match and no rank waits idle for another. Gathering in rank order gives back the list's order.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from vltrain.data.config import DataConfig
from vltrain.data.loading.loader import EvalLoader, build_eval_loader
from vltrain.data.tokenizers import Tokenizer
from vltrain.eval.labeled import TextListDataset
from vltrain.model.passes import Encode
from vltrain.runtime.distributed import all_gather_no_grad, pad_to
from vltrain.types import Tokens


@dataclass(frozen=True)
class Encoder:
    """What every evaluation embeds with: the wrapped task (its ``encode`` part), the device, the
    training's autocast, and the data config whose mean and std normalize the pixels."""

    wrapped: nn.Module
    data_cfg: DataConfig
    device: torch.device
    autocast: Callable


@dataclass
class Embedded:
    """Rows of one list (this rank's slice, or all of them once gathered)."""

    embeds: torch.Tensor
    """float32 [n, D], L2-normalized; zero rows where ``present`` is false."""
    present: torch.Tensor
    """bool [n]: the row's image could be read (always true for texts)."""
    tokens: torch.Tensor | Tokens | None = None
    """The tower's tokens (kept for ITM re-ranking only): an image list's as :class:`Tokens` (with
    the mask of real ones), a text list's [n, L, W] with their attention mask in ``mask``."""
    mask: torch.Tensor | None = None
    """int64 [n, L] the texts' attention mask (text lists with tokens only)."""
    errors: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(path, reason) of this rank's unreadable images."""

    def gathered(self) -> "Embedded":
        """Every rank's rows in list order (each tensor padded to the widest rank's shape)."""
        def gather(x):
            if x is None:
                return None
            # gloo gathers no bfloat16: widen, gather, narrow (all_gather_no_grad does bool)
            return all_gather_no_grad(x.float() if x.dtype == torch.bfloat16 else x).to(x.dtype)

        tokens = self.tokens
        tokens = Tokens(gather(tokens.values), gather(tokens.real)) if isinstance(tokens, Tokens) else gather(tokens)
        return Embedded(gather(self.embeds), gather(self.present), tokens, gather(self.mask), self.errors)


def text_loader(texts: list[str], tokenizer: Tokenizer, data_cfg: DataConfig, rank: int, world_size: int,
                batch_size: int) -> EvalLoader:
    """Texts tokenized once, batched in this process (no worker start-up for a few prompts)."""
    dataset = TextListDataset(texts, tokenizer, data_cfg.max_text_length)
    return build_eval_loader(dataclasses.replace(data_cfg, num_workers=0), dataset, rank=rank,
                             world_size=world_size, batch_size=batch_size, pad_id=tokenizer.pad_id)


def cat_padded(parts: list) -> torch.Tensor | Tokens:
    """Row-wise concatenation of batches whose second dimension (text width) may differ."""
    if isinstance(parts[0], Tokens):  # images: one width
        return Tokens.cat(parts)
    if parts[0].dim() < 2:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    return torch.cat([pad_to(p, (p.shape[0], width, *p.shape[2:])) for p in parts])


@torch.no_grad()
def embed_list(encoder: Encoder, loader: EvalLoader, side: str, keep_tokens: bool = False) -> Embedded:
    """This rank's rows of ``loader`` (``side``: "image" or "text"), in order, without padding rows."""
    embeds, present, tokens, masks, errors = [], [], [], [], {}
    for batch in loader:
        inputs = batch.to_model_inputs(encoder.device, encoder.data_cfg.mean, encoder.data_cfg.std)
        with encoder.autocast():
            enc = encoder.wrapped(Encode(inputs))
        image = side == "image"
        embeds.append((enc.image_embeds if image else enc.text_embeds).float())
        present.append(inputs.has_image if image else inputs.has_text)
        if keep_tokens:
            tokens.append(enc.image_tokens if image else enc.text_tokens)
            if not image:
                masks.append(inputs.attention_mask)
        errors.update(dict(batch.errors))  # a padding row repeats the last row's error
    n = loader.num_samples
    out = Embedded(torch.cat(embeds)[:n], torch.cat(present)[:n], errors=list(errors.items()))
    if keep_tokens:
        out.tokens = cat_padded(tokens)[:n]
        out.mask = cat_padded(masks)[:n] if masks else None
    return out


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def embed_gathered(encoder: Encoder, loader: EvalLoader, side: str, keep_tokens: bool = False) -> Embedded:
    """:func:`embed_list`, then every rank's rows (the whole list, in order) on every rank."""
    with eval_mode(encoder.wrapped):
        local = embed_list(encoder, loader, side, keep_tokens)
    return local.gathered()
