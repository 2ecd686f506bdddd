"""One optimizer step's forward and backward passes over its micro-batches.

Plain accumulation lives here; exact contrastive accumulation in :mod:`vltrain.train.gradcache`.
Both return the step's losses (already averaged the way they were optimised) and leave the
gradients of the whole step in ``.grad``, reduced across ranks by the last backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
from torch import nn

from vltrain.train.parallelize import gradient_sync
from vltrain.types import ModelInputs


@dataclass
class StepLosses:
    loss: torch.Tensor
    """The optimised total, detached; a 0-dim float tensor on the device."""
    losses: dict[str, torch.Tensor]
    rows: list[tuple[torch.Tensor | None, dict]] = field(default_factory=list)
    """Per micro-batch (or, for gradcache's contrastive term, per step): each row's source and each
    objective's per-row losses (``vltrain.objectives.scoring.RowLosses``), for per-source metrics."""

    def add(self, new: dict[str, torch.Tensor], scale: float) -> None:
        """Accumulate ``scale`` times each of ``new`` (detached, fp32) into ``losses``."""
        for k, v in new.items():
            v = v.detach().float() * scale
            self.losses[k] = self.losses[k] + v if k in self.losses else v


def plain_backward(
    wrapped: nn.Module,
    micro: list[ModelInputs],
    autocast: Callable[[], ContextManager],
    backward: Callable[[torch.Tensor], None],
    loss_scale: float = 1.0,
) -> StepLosses:
    """Mean of the micro-batches' losses; each micro-batch's contrastive loss sees only itself.

    ``wrapped`` is the (parallelized) :class:`vltrain.train.task.Task`. ``loss_scale`` multiplies the loss
    before backward (e.g. a fault-injection NaN).
    """
    n = len(micro)
    result = StepLosses(torch.zeros((), device=micro[0].pixels.device), {})
    for i, m in enumerate(micro):
        with gradient_sync(wrapped, i == n - 1):
            with autocast():
                out = wrapped("all", m)
            loss = out.loss.float() * loss_scale / n
            backward(loss)
        result.loss += loss.detach()
        result.add(out.losses, 1.0 / n)
        result.rows.append((m.source, out.rows))
    return result


def apply_update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, skip: torch.Tensor) -> None:
    """Apply the optimizer step unless ``skip`` (a 0-dim bool on the device that every rank agreed).

    A fused optimizer skips on the device, through the ``found_inf`` it reads as a gradient
    scaler's verdict: the parameters, both moments and the step count stay as they were, and
    the host never waits to learn which. With fp16's gradient scaler (whose step reads its own
    verdict on the host) or an unfused optimizer, the verdict is read here.
    """
    if not scaler.is_enabled() and optimizer.defaults.get("fused"):
        optimizer.found_inf = skip.to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        return
    if bool(skip):
        optimizer.zero_grad(set_to_none=True)
    else:
        scaler.step(optimizer)
