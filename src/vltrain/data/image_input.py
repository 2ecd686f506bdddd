"""The image a sample carries and how a batch lays its images out, decided once from the data config
(:func:`image_layout`): square images of ``data.image_size`` (crop or squash,
:func:`vltrain.data.images.decode_image`), or images at their own shape (``data.resize: native``,
:func:`vltrain.data.native.decode_native`), one to a row padded to ``data.max_patches`` or packed
several to a sequence (:mod:`vltrain.data.loading.packing`).

Every reader of images (training, evaluation, ``vltrain embed``, the teacher) decodes through the
layout (:func:`decode_for`; the training dataset through the layout's ``decode``, which also says
what part of the image the pixels hold, for its regions' boxes), so an image is seen the same way
everywhere; the collator fills the fields of :class:`vltrain.images.Images` the layout names, and
the dataset asks it for patch counts."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from vltrain.data.config import DataConfig
from vltrain.data.images import Seen, decode_seen
from vltrain.data.index.sizes import image_sizes
from vltrain.data.loading.packing import class_slots, layout
from vltrain.data.native import decode_native_seen, patch_counts
from vltrain.runtime.cpus import usable_cpus


class Decoded(NamedTuple):
    """An image as a layout decodes it: its pixels, its grid at its own shape (None: square), and
    which part of the image as shown they hold (what its regions' boxes are mapped through)."""

    image: torch.Tensor
    grid: tuple[int, int] | None
    seen: Seen


class SquareLayout:
    """Square images of ``size`` pixels: [B, 3, size, size], zeros where a row has none."""

    def __init__(self, size: int, data: DataConfig | None = None):
        self.size, self.data = size, data

    def decode(self, data: bytes) -> Decoded:
        """``uint8 [3, S, S]``, cropped or squashed as ``data.resize`` says."""
        d = self.data
        image, seen = decode_seen(data, d.image_size, d.resize, d.max_image_pixels, d.jpeg_draft_ratio,
                                  d.interpolation, d.jpeg_decoder)
        return Decoded(image, None, seen)

    def describe(self) -> str:
        return f"{self.size} px images, resize {self.data.resize}"

    def patch_counter(self, sources: list) -> None:
        """No patch counts: every image is one square."""
        return None

    def plan(self, images: list[torch.Tensor | None]) -> None:
        return None

    def shapes(self, n: int, plan: None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"pixels": ((n, 3, self.size, self.size), torch.uint8)}

    def put(self, t: dict[str, torch.Tensor], images: list, grids: list, plan: None) -> None:
        for i, image in enumerate(images):
            t["pixels"][i] = 0 if image is None else image


class PaddedLayout:
    """Images at their own shape, one to a row: each image's patches of ``patch`` pixels, then zeros
    to ``most`` (``data.max_patches``), beside its grid (1 x 1 where a row has none)."""

    def __init__(self, most: int, patch: int, data: DataConfig | None = None):
        self.most, self.patch, self.data = most, patch, data

    def decode(self, data: bytes) -> Decoded:
        """``uint8 [patches, 3 * p * p]`` of the image at its own shape, and its grid ``(rows, cols)``."""
        d = self.data
        return Decoded(*decode_native_seen(data, self.patch, self.most, min_patches=d.min_patches, upscale=d.upscale,
                                           resample=d.interpolation, max_pixels=d.max_image_pixels))

    def describe(self) -> str:
        drawn = self.data is not None and self.data.max_patches_choices
        return (f"images at their own shape, at most {self.most} patches of {self.patch} px"
                + (f", each step's budget drawn from {drawn}" if drawn else ""))

    def within(self, most: int) -> "PaddedLayout":
        """This layout for a step whose patch budget is ``most`` (``data.max_patches_choices``)."""
        return self if most == self.most else type(self)(most, self.patch, self.data)

    def patch_counter(self, sources: list):
        """A function giving each row's patch count at its own shape (0: no image): it reads every
        image's header once, so it is called on first use."""
        d = self.data

        def count() -> np.ndarray:
            workers = usable_cpus()
            sizes = np.concatenate([image_sizes(s, workers=workers) for s in sources])
            has_image = np.concatenate([np.asarray(s.has_image()) for s in sources])
            return patch_counts(sizes, has_image, self.patch, self.most, d.min_patches, d.upscale)

        return count

    def plan(self, images: list[torch.Tensor | None]) -> None:
        return None

    def shapes(self, n: int, plan: None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"pixels": ((n, self.most, 3 * self.patch**2), torch.uint8), "grids": ((n, 2), torch.int64)}

    def put(self, t: dict[str, torch.Tensor], images: list, grids: list, plan: None) -> None:
        pixels = t["pixels"]
        for i, image in enumerate(images):
            n = 0 if image is None else image.shape[0]
            if n:
                pixels[i, :n] = image
            pixels[i, n:] = 0
        self.put_grids(t, images, grids)

    @staticmethod
    def put_grids(t: dict[str, torch.Tensor], images: list, grids: list) -> None:
        rows = [g if image is not None else (1, 1) for image, g in zip(images, grids)]  # a row without one: 1 x 1
        t["grids"].copy_(torch.tensor(rows, dtype=torch.int64))


class PackedLayout(PaddedLayout):
    """Images at their own shape packed into as few sequences of ``most`` positions as hold them
    (:mod:`.packing`), with whose patch each position holds and each sequence's class-token slots."""

    def plan(self, images: list[torch.Tensor | None]):
        """(places, segments, patch_index, slots) of the batch's images."""
        sizes = [0 if image is None else image.shape[0] for image in images]
        places, segments, patch_index = layout(sizes, self.most)
        return places, segments, patch_index, class_slots(places, sizes, segments.shape[0])

    def shapes(self, n: int, plan) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        sequences, slots = plan[3].shape
        return {"pixels": ((sequences, self.most, 3 * self.patch**2), torch.uint8), "grids": ((n, 2), torch.int64),
                "segments": ((sequences, self.most), torch.int64), "patch_index": ((sequences, self.most), torch.int64),
                "slots": ((sequences, slots), torch.int64)}

    def put(self, t: dict[str, torch.Tensor], images: list, grids: list, plan) -> None:
        places, segments, patch_index, slots = plan
        pixels = t["pixels"]
        for (seq, offset), image in zip(places, images):
            if image is not None:
                pixels[seq, offset:offset + image.shape[0]] = image
        pixels.masked_fill_((segments < 0)[..., None], 0)
        self.put_grids(t, images, grids)
        t["segments"].copy_(segments)
        t["patch_index"].copy_(patch_index)
        t["slots"].copy_(slots)


ImageLayout = SquareLayout | PaddedLayout | PackedLayout


def image_layout(cfg: DataConfig, max_patches: int = 0) -> ImageLayout:
    """How ``cfg``'s images are collated (the fields of :class:`~vltrain.images.Images` they fill),
    decided here once: square, or at their own shape padded one to a row or packed, within
    ``max_patches`` (a step's drawn budget, ``data.max_patches_choices``; 0: ``data.max_patches``)."""
    if not cfg.at_own_shape():
        return SquareLayout(cfg.image_size, cfg)
    layout = PackedLayout if cfg.pack_images else PaddedLayout
    return layout(max_patches or cfg.max_patches, cfg.native_patch(), cfg)


def decode_for(data: bytes, cfg: DataConfig) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """``(uint8 [3, S, S], None)``, or at its own shape ``(uint8 [patches, 3 * p * p], (rows, cols))``."""
    image, grid, _ = image_layout(cfg).decode(data)
    return image, grid
