"""One batch of images in any layout (:class:`Images`): square, at their own shape one to a row
(padded), or packed several to a sequence; with or without the patches patch dropout keeps.

The layout travels with the pixels, as the mask travels with a tower's tokens (:class:`Tokens`):
the collator makes it, the vision tower's embedding reads it, and masked image modelling and
patch dropout ask it which patch positions are real instead of working it out again. It sits in
the bottom layer, beside ``types.py`` and ``pixels.py``, so the loader, the model and the
objectives share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from vltrain.pixels import packed_places, patchify, unpack


@dataclass(frozen=True)
class Images:
    """A batch of images and its layout. Three layouts, told apart by which tensors are present:

    - square: ``pixels`` [B, 3, H, W], every patch real;
    - padded (``data.resize: native``): ``pixels`` [B, N, 3 * p * p], image i's first rows x cols
      patches (``grids[i]``), row by row, then zeros to N;
    - packed: ``pixels`` [S, N, 3 * p * p], several images to a sequence,
      ``segments`` and ``patch_index`` saying whose patch each position holds.

    Whatever the layout, an image has N patch positions in the padded layout (a square one, its
    H / p * W / p), and :attr:`real` says which of them hold a patch. Regions' boxes belong to the
    images, one row per image in every layout (packed ones too), and travel with them.
    """

    pixels: torch.Tensor
    """float (uint8 in the loader) [B, 3, H, W] square; [B, N, 3 * p * p] padded; [S, N, 3 * p * p] packed."""
    grids: torch.Tensor | None = None
    """int64 [B, 2]: the rows and columns of patches each image was resized to (None: square)."""
    segments: torch.Tensor | None = None
    """int64 [S, N], packed: the row whose image each position holds (-1: padding)."""
    patch_index: torch.Tensor | None = None
    """int64 [S, N], packed: which patch of its image each position holds."""
    slots: torch.Tensor | None = None
    """int64 [S, K], packed: the rows whose images each sequence holds, in order (-1: none), where a
    tower with a class token puts their class tokens."""
    keep: torch.Tensor | None = None
    """int64 [B, K], ascending: patch dropout in a training step, the patch positions each image
    keeps, drawn keyed by the step and the sample (``Objectives.patch_keep``); None: every patch."""
    boxes: torch.Tensor | None = None
    """float32 [B, R, 4]: each image's regions (docs/formats.md#regions), x0, y0, x1, y1 in [0, 1]
    of the image as the model sees it (x by its width, y by its height), in the row's order, zeros
    past its own; R is the batch's most. None: no row of the batch keeps one. R, and whether it is
    None, differ between ranks and batches."""
    box_mask: torch.Tensor | None = None
    """bool [B, R]: which of ``boxes`` are real (with ``boxes``)."""

    @property
    def layout(self) -> str:
        """square | padded | packed."""
        if self.segments is not None:
            return "packed"
        return "square" if self.grids is None else "padded"

    def __len__(self) -> int:
        """The number of rows (images, or rows without one), not of packed sequences."""
        return int((self.pixels if self.layout == "square" else self.grids).shape[0])

    def positions(self, patch_size: int) -> int:
        """N, each image's patch positions in the padded layout (a square image's H / p * W / p)."""
        if self.layout == "square":
            return (self.pixels.shape[-2] // patch_size) * (self.pixels.shape[-1] // patch_size)
        return int(self.pixels.shape[1])  # padded: [B, N, ...]; packed: [S, N, ...]

    @property
    def real(self) -> torch.Tensor | None:
        """bool [B, N]: which of each image's patch positions hold a patch; None when all do (square)."""
        if self.layout == "square":
            return None
        return real_patches(self.grids, self.positions(1))

    def among_real(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` [B, N] (bool) limited to the real patch positions."""
        real = self.real
        return mask if real is None else mask & real

    def patches(self, patch_size: int) -> torch.Tensor:
        """[B, N, 3 * p * p] each image's patches (channel, y, x within a patch), as the padded layout
        has them (not packed: see :meth:`unpacked`)."""
        return patchify(self.pixels, patch_size) if self.layout == "square" else self.pixels

    def unpacked(self) -> "Images":
        """The same images one to a row, as the padded layout has them: each image's patches, then
        zeros to N (masked image modelling regresses them). Square and padded ones as they are."""
        if self.layout != "packed":
            return self
        pixels = unpack(self.pixels, packed_places(self.segments, self.patch_index, len(self)))
        pixels = pixels.masked_fill(~real_patches(self.grids, pixels.shape[1])[..., None], 0)
        return Images(pixels, self.grids, keep=self.keep, boxes=self.boxes, box_mask=self.box_mask)

    def kept(self, keep: torch.Tensor | None) -> "Images":
        """The same images seeing only the ``keep`` patches (patch dropout; None: every patch). The
        vision tower's patch dropout applies it."""
        return replace(self, keep=keep)

    def __getitem__(self, rows) -> "Images":
        """Some rows (an index, a bool mask or a slice over dim 0; one to a row: square or padded)."""
        return self._rows(lambda t: t[rows])

    def index_select(self, dim: int, index: torch.Tensor) -> "Images":
        """Some rows (``dim`` 0, as a tensor's; one to a row: square or padded)."""
        return self._rows(lambda t: t.index_select(dim, index))

    def dummy(self) -> "Images":
        """One row of zeros standing for a batch without images, so every rank runs the tower: at
        their own shape, an image of one patch."""
        first = self[:1]
        return Images(torch.zeros_like(first.pixels), torch.ones_like(first.grids) if self.layout == "padded" else None,
                      keep=first.keep)

    def _rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Images":
        if self.layout == "packed":
            raise ValueError("packed images are not picked by rows; unpack them first")
        return self.map(fn)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Images":
        """``fn`` applied to every tensor (a move to the device, pinning)."""
        return Images(**{name: fn(t) for name, t in self.tensors().items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors present, by field name (how a :class:`~vltrain.data.batch.Batch` ships them)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def real_patches(grids: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length] (bool): which of a padded batch's patch positions hold a patch, for images at their
    own shape: each image's first rows x cols of ``grids`` [B, 2] (:attr:`Images.grids`)."""
    return torch.arange(length, device=grids.device) < (grids[:, 0] * grids[:, 1])[:, None]
