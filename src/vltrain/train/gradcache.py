"""Exact contrastive accumulation ("gradient caching") over a step's micro-batches.

A contrastive loss couples every pair of the global batch, so accumulating per-micro-batch
losses optimises a different (weaker, fewer negatives) objective. Caching computes the real
gradient while keeping only one micro-batch's activations:

1. embed every micro-batch without autograd, keep the embeddings (small);
2. compute the contrastive loss over all cached embeddings, gathered across ranks, and take
   its gradient with respect to the embeddings only;
3. re-run each micro-batch with autograd and back-propagate ``sum(embedding * cached grad)``
   plus its non-contrastive objectives (ITM, MLM); the last micro-batch rebuilds the full loss
   instead (:meth:`vltrain.train.task.ContrastiveCache.term`).

Each micro-batch's RNG state is recorded before its encoding in step 1 and restored before
its encoding in step 3, so any randomness in encoding repeats in both passes. The
non-contrastive objectives (ITM negatives, MLM masks) run only in step 3; their draws are keyed
by the step and the sample ids, so they do not depend on the generators at all.
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
from torch import nn

from vltrain.train.parallelize import gradient_sync
from vltrain.train.step import StepLosses
from vltrain.train.task import ContrastiveCache, GeneratorState
from vltrain.types import ModelInputs, Rows


def _cache(wrapped: nn.Module, micro: list[ModelInputs], autocast, loss_scale: float
           ) -> tuple[ContrastiveCache, torch.Tensor, dict, list[GeneratorState]]:
    """Steps 1 and 2: the cache, the contrastive loss and its per-row losses, and each micro-batch's
    RNG state before its encoding."""
    device = micro[0].pixels.device
    states, img_cache, txt_cache = [], [], []
    with torch.no_grad():
        for m in micro:
            states.append(GeneratorState(device))
            with autocast():
                enc = wrapped("encode", m)
            img_cache.append(enc.image_embeds.float())
            txt_cache.append(enc.text_embeds.float())

    img_all = torch.cat(img_cache).requires_grad_(True)
    txt_all = torch.cat(txt_cache).requires_grad_(True)
    rows = Rows.cat([m.rows() for m in micro])
    # gradients to the embeddings only; no parameter gradient is touched or reduced here
    with gradient_sync(wrapped, False):
        with autocast():
            closs, row_losses = wrapped("contrastive", img_all, txt_all, rows)
        g_img, g_txt = torch.autograd.grad(closs.float() * loss_scale, [img_all, txt_all])
    bounds = [0]
    for m in micro:
        bounds.append(bounds[-1] + len(m))
    cache = ContrastiveCache(img_all, txt_all, g_img, g_txt, rows, bounds, loss_scale)
    return cache, closs, row_losses, states


def gradcache_backward(
    wrapped: nn.Module,
    micro: list[ModelInputs],
    autocast: Callable[[], ContextManager],
    backward: Callable[[torch.Tensor], None],
    loss_scale: float = 1.0,
) -> StepLosses:
    """Leave in ``.grad`` the gradient of (contrastive loss over the global batch + mean of the
    micro-batches' other objectives); return those losses."""
    n = len(micro)
    cache, closs, row_losses, states = _cache(wrapped, micro, autocast, loss_scale)
    result = StepLosses(closs.detach().float() * loss_scale, {"contrastive": closs.detach().float()})
    result.rows.append((cache.rows.source, row_losses))
    for i, m in enumerate(micro):
        with gradient_sync(wrapped, i == n - 1):
            with autocast():
                contrastive, other = wrapped("replay", m, cache, i, states[i])
            other_loss = other.loss.float() * loss_scale / n
            backward(contrastive + other_loss)
        result.loss += other_loss.detach()
        result.add(other.losses, 1.0 / n)
        result.rows.append((m.source, other.rows))
    return result
