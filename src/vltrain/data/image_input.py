"""The image a sample carries, as ``data.resize`` asks: a square of ``data.image_size`` (crop or
squash, :func:`vltrain.data.images.decode_image`) or, with ``native``, the patches of the image at
its own shape and their grid (:func:`vltrain.data.native.decode_native`). Every reader of images
(training, evaluation, ``vltrain embed``) goes through :func:`decode_for`, so an image is seen the
same way everywhere."""

from __future__ import annotations

import torch

from vltrain.data.config import DataConfig
from vltrain.data.images import decode_image
from vltrain.data.native import decode_native


def decode_for(data: bytes, cfg: DataConfig) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """``(uint8 [3, S, S], None)``, or at its own shape ``(uint8 [patches, 3 * p * p], (rows, cols))``."""
    if cfg.resize != "native":
        return decode_image(data, cfg.image_size, cfg.resize, cfg.max_image_pixels, cfg.jpeg_draft_ratio,
                            cfg.interpolation, cfg.jpeg_decoder), None
    return decode_native(data, cfg.native_patch(), cfg.max_patches, min_patches=cfg.min_patches, upscale=cfg.upscale,
                         resample=cfg.interpolation, max_pixels=cfg.max_image_pixels)
