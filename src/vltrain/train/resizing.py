"""The vision tower's position table resized where a stage changes the square image size
(``train.stages`` ``image_size``; SigLIP 2's fixed-resolution variants go on at 95% at a higher
resolution with their table resized).

The table is a parameter of another shape afterwards, so where a stage resizes it the run keeps it
whole on every rank, outside DDP's and FSDP2's reduction (:func:`vltrain.train.parallelize.parallelize`),
and this module swaps the new parameter in everywhere the old one was: the tower, the optimizer
(whose moments for it start again), the weight EMA (its average resized the same way) and the
step's list of parameters. Which size a step trains at is a function of the step, so a resumed run
resizes its table before the checkpoint is read (:func:`fit_table`), and reads the resized one.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from vltrain.model.vision import resized_table


def fit_table(wrapped: nn.Module, model: nn.Module, image_size: int, optimizer: torch.optim.Optimizer,
              ema=None, step_fn=None) -> bool:
    """Resize ``model``'s vision position table to square images of ``image_size`` where it is of
    another size, swapping the new parameter in for the old one in ``optimizer`` (its state for it
    dropped), ``ema`` and ``step_fn``'s parameters, and ``wrapped``'s replicated ones. Returns
    whether it resized."""
    vision = model.vision
    patch, prefix = vision.cfg.patch_size, vision.num_prefix
    grid, new_grid = vision.cfg.image_size // patch, image_size // patch
    if grid == new_grid:
        return False
    old = vision.pos_embed

    def resize(table: torch.Tensor) -> torch.Tensor:
        return resized_table(table.detach(), prefix, grid, new_grid)

    new = nn.Parameter(resize(old), requires_grad=old.requires_grad)
    vision.pos_embed, vision.cfg = new, replace(vision.cfg, image_size=image_size)
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    optimizer.state.pop(old, None)
    if ema is not None:
        ema.swap(old, new, resize)
    if step_fn is not None:
        step_fn.params = [new if p is old else p for p in step_fn.params]
    replicated = getattr(wrapped, "replicated_params", None)
    if replicated is not None:
        wrapped.replicated_params = [new if p is old else p for p in replicated]
    return True
