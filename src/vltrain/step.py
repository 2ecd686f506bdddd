"""One optimizer step's forward and backward passes over its micro-batches.

Plain accumulation lives here; exact contrastive accumulation in :mod:`vltrain.gradcache`.
Both return the step's losses (already averaged the way they were optimised) and leave the
gradients of the whole step in ``.grad``, reduced across ranks by the last backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from vltrain.parallelize import gradient_sync


@dataclass
class ModelInputs:
    """What the model takes from a Batch, on the device, pixels normalized."""

    pixels: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    has_image: torch.Tensor
    has_text: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor | None = None

    def encoder_args(self) -> tuple:
        return (self.pixels, self.input_ids, self.attention_mask, self.has_image, self.has_text)


@dataclass
class StepLosses:
    loss: torch.Tensor
    """The optimised total, detached; a 0-dim float tensor on the device."""
    losses: dict[str, torch.Tensor]


def _add(acc: dict[str, torch.Tensor], new: dict[str, torch.Tensor], scale: float) -> None:
    for k, v in new.items():
        v = v.detach().float() * scale
        acc[k] = acc[k] + v if k in acc else v


def plain_backward(
    wrapped: nn.Module,
    micro: list[ModelInputs],
    autocast: Callable[[], ContextManager],
    backward: Callable[[torch.Tensor], None],
    loss_scale: float = 1.0,
) -> StepLosses:
    """Mean of the micro-batches' losses; each micro-batch's contrastive loss sees only itself.

    ``loss_scale`` multiplies the loss before backward (e.g. a fault-injection NaN).
    """
    n = len(micro)
    total = torch.zeros((), device=micro[0].pixels.device)
    losses: dict[str, torch.Tensor] = {}
    for i, m in enumerate(micro):
        with gradient_sync(wrapped, i == n - 1):
            with autocast():
                out = wrapped(*m.encoder_args(), m.ids, m.weights)
            loss = out.loss.float() * loss_scale / n
            backward(loss)
        total += loss.detach()
        _add(losses, out.losses, 1.0 / n)
    return StepLosses(total, losses)
