"""AdamW with the usual decay exemptions, warmup + cosine, layer-wise lr decay, and freezing a tower.

The model names the parameters that take no weight decay (``no_weight_decay``) and the layer each
tower parameter sits in (``layer_ids``, see :mod:`vltrain.model.weight_decay`); parameters go to one
group per (lr scale, weight decay).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from vltrain.config.job import TrainConfig
from vltrain.errors import ConfigError
from vltrain.model.weight_decay import default_no_weight_decay
from vltrain.train.parallelize import apart_from_shards
from vltrain.types import TrainableModel

log = logging.getLogger(__name__)


def freeze_towers(model: nn.Module, towers: list[str], unlock_last: int | dict[str, int] = 0) -> None:
    """LiT-style locking: a named tower (``vision``, ``text``, ...) keeps its weights.

    ``unlock_last`` (a count for every named tower, or per tower) leaves the last blocks of a
    frozen tower and its final norm training: the top of a pretrained tower adapts, the bottom
    keeps its general features.
    """
    for name in towers:
        tower = getattr(model, name, None)
        if not isinstance(tower, nn.Module):
            children = [n for n, _ in model.named_children()]
            raise ConfigError(f"train.freeze names {name!r}, which is not a tower of the model (towers: {children})")
        tower.requires_grad_(False)
        n = unlock_last.get(name, 0) if isinstance(unlock_last, dict) else unlock_last
        if n:
            _unlock(name, tower, n)


def _unlock(name: str, tower: nn.Module, n: int) -> None:
    blocks = list(getattr(tower, "blocks", []))
    if n > len(blocks):
        raise ConfigError(f"train.unlock_last asks for the last {n} blocks of {name!r}, which has "
                          f"{len(blocks)}; give at most {len(blocks)}")
    for block in blocks[len(blocks) - n:]:
        block.requires_grad_(True)
    final = getattr(tower, "norm", None)
    if isinstance(final, nn.Module):
        final.requires_grad_(True)


def lr_scales(model: nn.Module, layer_decay: float) -> dict[str, float]:
    """Each tower parameter's lr multiplier, ``layer_decay ** (top - layer)``; others train at 1."""
    if not isinstance(model, TrainableModel):
        raise ConfigError(f"train.layer_decay needs a model that names its layers ({type(model).__name__} does not)")
    return {name: layer_decay ** (top - layer) for name, (layer, top) in model.layer_ids().items()}


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float = 1.0) -> list[dict]:
    """Trainable parameters (frozen ones are left out) grouped by weight decay and lr scale.

    Without layer decay: two groups, with and without weight decay. With it: one group per
    (lr scale, with or without weight decay), the largest scale first (its lr is the one logged),
    each holding its ``lr_scale``.
    """
    exempt = model.no_weight_decay() if isinstance(model, TrainableModel) else default_no_weight_decay(model)
    scales = lr_scales(model, layer_decay) if layer_decay != 1.0 else {}
    found: dict[tuple[float, bool], list[nn.Parameter]] = {}  # (lr scale, decayed) -> parameters
    for name, p in model.named_parameters():
        if p.requires_grad:
            found.setdefault((scales.get(name, 1.0), name not in exempt), []).append(p)
    keys = [(1.0, True), (1.0, False)] if layer_decay == 1.0 else sorted(found, key=lambda k: (-k[0], not k[1]))
    groups = [{"params": found.get(k, []), "weight_decay": weight_decay if k[1] else 0.0} for k in keys]
    if layer_decay != 1.0:
        for g, (scale, _) in zip(groups, keys):
            g["lr_scale"] = scale
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; a scaled group's lr is ``train.lr x lr_scale``, which the
    scheduler's multiplier then scales (LambdaLR keeps each group's initial lr)."""
    groups = param_groups(model, cfg.weight_decay, cfg.layer_decay)
    if not groups:
        raise ConfigError("every parameter is frozen (train.freeze): there is nothing to train")
    for g in groups:
        if "lr_scale" in g:
            g["lr"] = cfg.lr * g["lr_scale"]
    groups = whole_apart(groups)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **implementation(groups))


def whole_apart(groups: list[dict]) -> list[dict]:
    """Each group split as :func:`~vltrain.train.parallelize.apart_from_shards` splits it: under
    FSDP2, a whole parameter of more than one dimension (a position table a stage resizes) in a group
    of its own beside its group, which DTensor's fused update does not mix with the shards."""
    return [{**g, "params": part} for g in groups for part in apart_from_shards(g["params"]) if part]


def implementation(groups: list[dict]) -> dict[str, bool]:
    """``fused`` when every parameter is a floating-point tensor on the CPU or on CUDA, else ``foreach``.

    The fused kernel updates a parameter in one pass over it and its two moments, with no
    temporaries; ``foreach`` makes several passes, and on the CPU it allocates a full-size
    temporary per parameter for each of them. On the CPU the fused step is some 8x faster for a
    CLIP's 63M parameters (``docs/benchmarks/cpu-training.md#one-step-against-transformers``). Both handle
    FSDP2's DTensor parameters. The two round differently (up to 2e-7 relative per step), so a
    run keeps one: a resumed checkpoint brings back the implementation it was saved with.
    """
    params = [p for g in groups for p in g["params"]]
    devices = {p.device.type for p in params}
    if params and len(devices) == 1 and devices <= {"cpu", "cuda"} and all(p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": True}


class WarmupCosine:
    """lr multiplier: linear warmup from ~0 to 1, then cosine down to ``min_ratio`` at ``total``.

    ``stretches``: (first step, factor) of the stages that slow the schedule down (``train.stages``
    ``lr_stretch``): from its first step on, a step advances the schedule 1 / factor; the schedule
    is then a function of that schedule time, and ends at the schedule time of ``total``
    (:func:`vltrain.config.stages.schedule_time`). None: the steps themselves.

    A class rather than a closure so that the scheduler pickles and its shape shows up in reprs.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.0,
                 stretches: tuple[tuple[int, float], ...] = ()):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        self.stretches = tuple(stretches)

    def __call__(self, step: int) -> float:
        if self.stretches:
            return self._at(self._time(step), self._time(self.total))
        return self._at(step, self.total)

    def _at(self, step: float, total: float) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        span = max(1, total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def _time(self, step: int) -> float:
        t, start, factor = 0.0, 0, 1.0
        for first, f in self.stretches:
            if first >= step:
                break
            t += (first - start) / factor
            start, factor = first, f
        return t + (step - start) / factor

    def __repr__(self) -> str:
        stretched = f", stretches={self.stretches}" if self.stretches else ""
        return f"WarmupCosine(warmup={self.warmup}, total={self.total}, min_ratio={self.min_ratio}{stretched})"


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                    stretches: tuple[tuple[int, float], ...] = ()) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (Stateful: its step count is checkpointed) over :class:`WarmupCosine` (``stretches``:
    the stages' ``lr_stretch``, by first step). A warmup
    longer than half the run is said: the learning rate would barely reach its peak."""
    warmup = cfg.warmup()
    if warmup > cfg.max_steps / 2:
        log.warning("train.warmup_steps=%s is %d of train.max_steps=%d steps: the learning rate reaches its peak "
                    "only at step %d. Give a fraction instead (train.warmup_steps=0.05 warms up over 5%% of the run) "
                    "or fewer steps.", cfg.warmup_steps, warmup, cfg.max_steps, warmup)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup, cfg.max_steps, cfg.min_lr_ratio, stretches)
    )
