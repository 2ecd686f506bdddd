"""AdamW with the usual decay exemptions, warmup + cosine, and freezing a tower.

The model names the parameters that take no weight decay (``no_weight_decay``, see
:mod:`vltrain.model.protocol`); they go to a group of their own.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vltrain.config import TrainConfig
from vltrain.errors import ConfigError
from vltrain.model.protocol import TrainableModel, default_no_weight_decay


def freeze_towers(model: nn.Module, towers: list[str]) -> None:
    """LiT-style locking: a named tower (``vision``, ``text``, ...) keeps its weights."""
    for name in towers:
        tower = getattr(model, name, None)
        if not isinstance(tower, nn.Module):
            children = [n for n, _ in model.named_children()]
            raise ConfigError(f"train.freeze names {name!r}, which is not a tower of the model (towers: {children})")
        tower.requires_grad_(False)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups of trainable parameters: with and without decay (frozen ones are left out)."""
    exempt = model.no_weight_decay() if isinstance(model, TrainableModel) else default_no_weight_decay(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name in exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ConfigError("every parameter is frozen (train.freeze): there is nothing to train")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **implementation(groups))


def implementation(groups: list[dict]) -> dict[str, bool]:
    """``fused`` when every parameter is a floating-point CUDA tensor, else ``foreach``.

    The fused kernel updates all parameters in a few launches (one pass over the optimizer
    state instead of several); it exists for CUDA only. foreach, the fast path elsewhere, also
    handles FSDP2's DTensor parameters on any device.
    """
    params = [p for g in groups for p in g["params"]]
    if params and all(p.is_cuda and p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": True}


class WarmupCosine:
    """lr multiplier: linear warmup from ~0 to 1, then cosine down to ``min_ratio`` at ``total``.

    A class rather than a closure so that the scheduler pickles and its shape shows up in reprs.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.0):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def __repr__(self) -> str:
        return f"WarmupCosine(warmup={self.warmup}, total={self.total}, min_ratio={self.min_ratio})"


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (Stateful: its step count is checkpointed) over :class:`WarmupCosine`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    )
