"""Exact contrastive accumulation ("gradient caching") over a step's micro-batches.

A contrastive loss couples every pair of the global batch, so accumulating per-micro-batch
losses optimises a different (weaker, fewer negatives) objective. Caching computes the real
gradient while keeping only one micro-batch's activations:

1. embed every micro-batch without autograd, keep the embeddings (small);
2. compute the contrastive loss over all cached embeddings, gathered across ranks, and take
   its gradient with respect to the embeddings only;
3. re-run each micro-batch with autograd and back-propagate ``sum(embedding * cached grad)``
   plus its non-contrastive objectives (ITM, MLM). For the last micro-batch the full
   contrastive loss is rebuilt from the cache with the live slice in place instead, so that
   the temperature gets its gradient exactly once, through the ordinary backward.

Each micro-batch's RNG state is recorded before its encoding in step 1 and restored before
its encoding in step 3, so dropout draws the same masks in both passes. The non-contrastive
objectives (ITM negatives, MLM masks) run only in step 3 and draw from one running stream
that continues from where step 1 left it, so they never repeat a draw.
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
from torch import nn

from vltrain.parallelize import gradient_sync
from vltrain.step import ModelInputs, StepLosses, _add


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _cat(micro: list[ModelInputs], name: str) -> torch.Tensor | None:
    parts = [getattr(m, name) for m in micro]
    return None if parts[0] is None else torch.cat(parts)


def _encode(model: nn.Module, m: ModelInputs):
    return model.encode(*m.encoder_args())


def _contrastive(model: nn.Module, img: torch.Tensor, txt: torch.Tensor, micro: list[ModelInputs]) -> torch.Tensor:
    return model.contrastive_loss(
        img, txt, _cat(micro, "has_image"), _cat(micro, "has_text"), _cat(micro, "ids"), _cat(micro, "weights")
    )


def _objectives(model: nn.Module, enc, m: ModelInputs):
    return model.objectives(
        enc, m.input_ids, m.attention_mask, m.has_image, m.has_text, m.ids, m.weights, contrastive=False
    )


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
    device = micro[0].pixels.device
    states, img_cache, txt_cache = [], [], []
    with torch.no_grad():
        for m in micro:
            states.append(_rng_state(device))
            with autocast():
                enc = wrapped(m, run=_encode)
            img_cache.append(enc.image_embeds.float())
            txt_cache.append(enc.text_embeds.float())
    after = _rng_state(device)

    img_all = torch.cat(img_cache).requires_grad_(True)
    txt_all = torch.cat(txt_cache).requires_grad_(True)
    # gradients to the embeddings only; no parameter gradient is touched or reduced here
    with gradient_sync(wrapped, False):
        with autocast():
            closs = wrapped(img_all, txt_all, micro, run=_contrastive)
        g_img, g_txt = torch.autograd.grad(closs.float() * loss_scale, [img_all, txt_all])

    bounds = [0]
    for m in micro:
        bounds.append(bounds[-1] + m.ids.shape[0])
    losses: dict[str, torch.Tensor] = {"contrastive": closs.detach().float()}
    total = closs.detach().float() * loss_scale
    running = [after]  # the RNG stream the objectives draw from (ITM negatives, MLM masks)
    for i, m in enumerate(micro):
        last = i == n - 1
        lo, hi = bounds[i], bounds[i + 1]

        def run(model: nn.Module, m: ModelInputs = m, state: tuple = states[i]) -> tuple[torch.Tensor, object]:
            _set_rng_state(state, device)  # the encoders draw what they drew in the first pass
            enc = model.encode(*m.encoder_args())
            _set_rng_state(running[0], device)
            img, txt = enc.image_embeds.float(), enc.text_embeds.float()
            if last:
                full_img = torch.cat([img_all.detach()[:lo], img, img_all.detach()[hi:]])
                full_txt = torch.cat([txt_all.detach()[:lo], txt, txt_all.detach()[hi:]])
                contrastive = _contrastive(model, full_img, full_txt, micro).float() * loss_scale
            else:
                contrastive = (img * g_img[lo:hi]).sum() + (txt * g_txt[lo:hi]).sum()
            other = _objectives(model, enc, m)
            running[0] = _rng_state(device)
            return contrastive, other

        with gradient_sync(wrapped, last):
            with autocast():
                contrastive, other = wrapped(run=run)
            other_loss = other.loss.float() * loss_scale / n
            backward(contrastive + other_loss)
        total += other_loss.detach()
        _add(losses, other.losses, 1.0 / n)
    return StepLosses(total, losses)
