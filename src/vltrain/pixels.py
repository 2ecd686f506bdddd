"""The pixel conventions the data and the model must share: the order an image is cut into patches
(:func:`patchify`).

The loader cuts native-shape images into patches (``data/native.py``), the vision tower cuts square
images the same way before its patch embedding (``model/vision.py``), and masked image modelling
regresses patches in that order (``objectives/losses.py``). The convention holds only if all of them
use one definition. ``data/`` and ``model/`` import neither each other, so it sits below both, in the
layer of ``types.py`` (what every layer passes on), and imports nothing of vltrain.
"""

from __future__ import annotations

import torch


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[..., C, H, W] -> [..., H/p * W/p, C * p * p]: patches in row-major grid order, each flattened
    (channel, y, x), the order of a patch-embedding convolution's ``weight.flatten(1)``."""
    *lead, c, h, w = pixels.shape
    if h % patch or w % patch:
        raise ValueError(f"image {h}x{w} is not a whole number of {patch}-pixel patches")
    n = len(lead)
    grid = pixels.reshape(*lead, c, h // patch, patch, w // patch, patch)
    grid = grid.permute(*range(n), n + 1, n + 3, n, n + 2, n + 4)
    return grid.reshape(*lead, (h // patch) * (w // patch), c * patch * patch)
