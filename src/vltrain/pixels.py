"""The pixel conventions the data and the model must share: the order an image is cut into patches
(:func:`patchify`), where a packed image's patches lie (:func:`packed_places`, :func:`unpack`),
which patches patch dropout keeps (:func:`kept_patches`, and of packed ones :func:`drop_packed`) and the names
of the resampling filters (:data:`RESAMPLE`).

The loader cuts native-shape images into patches (``data/native.py``), the vision tower cuts square
images the same way before its patch embedding (``model/vision.py``), and masked image modelling
regresses patches in that order (``objectives/losses.py``); the vision tower lays packed images'
tokens out one image per row, and masked image modelling their patches, by one rule; an image's
filter is named in ``data.interpolation``, read from and written to Hugging Face image processors
(``model/interop/hf_clip.py``, ``export/hf.py``) and handed to Pillow (``data/native.py``). Each
convention holds only if all of them use one definition. ``data/`` and ``model/`` import neither
each other, so it sits below both, in the layer of ``types.py`` (what every layer passes on), and
imports nothing of vltrain; it needs no Pillow either, so the model does not load it.
"""

from __future__ import annotations

import math

import torch

RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
"""Resampling filter names -> Pillow's codes (``PIL.Image.Resampling``), the integers Hugging Face
image processors store as ``resample``."""
INTERPOLATIONS = ("bicubic", "bilinear")
"""The filters ``data.interpolation`` offers: torch's antialiased kernels resize square images, and
only these two of Pillow's filters have one."""


def resample_code(resample: str | int) -> int:
    """Pillow's code for a filter's name ("bilinear", any case) or for a code itself (2)."""
    if isinstance(resample, int) and not isinstance(resample, bool) and resample in RESAMPLE.values():
        return resample
    if isinstance(resample, str) and resample.lower() in RESAMPLE:
        return RESAMPLE[resample.lower()]
    raise ValueError(f"unknown resample {resample!r}: use one of {sorted(RESAMPLE)} or Pillow's codes 0-5")


def resample_name(code: object) -> str | None:
    """The name of Pillow's filter ``code`` (an image processor's ``resample``); None for no filter."""
    return next((name for name, c in RESAMPLE.items() if c == code and not isinstance(code, bool)), None)


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


def packed_places(segments: torch.Tensor, patch_index: torch.Tensor, rows: int, width: int | None = None) -> torch.Tensor:
    """[rows, width]: where each row's patches lie in a packed batch (``segments`` and ``patch_index``
    [S, N], ``ModelInputs``' packed layout), as flat positions over its S x N: row i's patch j at
    ``[i, j]``, in the order of the padded layout (``width``: its positions per row, N unless the
    sequences were shortened to kept patches, :func:`drop_packed`). Positions past a row's last
    patch, of a patch not in the sequences, and of a row without an image say 0: a real position of
    some image, which readers of the padded layout never read (its mask says so). Found on the device
    with no host synchronization."""
    sequences, length = segments.shape
    width = length if width is None else width
    flat = torch.arange(sequences * length, device=segments.device)
    # each packed position's place in the padded layout; padding goes to one spare slot, dropped
    target = torch.where(segments >= 0, segments * width + patch_index, rows * width).flatten()
    places = torch.zeros(rows * width + 1, dtype=torch.int64, device=segments.device)
    return places.scatter_(0, target, flat)[:-1].view(rows, width)


def drop_packed(pixels: torch.Tensor, real: torch.Tensor, segments: torch.Tensor, patch_index: torch.Tensor,
                keep: torch.Tensor, images_per_sequence: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed images under patch dropout: each sequence keeps only its images' kept patches
    (``keep`` [B, K], :func:`kept_patches` of the padded layout's N positions; ``real`` [B, N] which of
    those hold a patch, ``vltrain.types.real_patches``), moved to its front in
    their order, and is cut to ``K + images_per_sequence`` positions: no sequence keeps more (an
    image of r patches keeps ``r - floor(f * r)`` < ``(1 - f) * r + 1`` of them, its r sum to at most N
    in a sequence, and ``K = N - floor(f * N)`` >= ``(1 - f) * N``), and the bound comes from shapes
    alone, so no count leaves the device. Returns the shortened ``pixels`` [S, N', ...], ``segments``
    (-1 past the kept patches) and ``patch_index`` (each kept patch's place in its image, as before)."""
    n = segments.shape[1]
    kept_rows = torch.zeros_like(real).scatter_(1, keep, True) & real
    kept = kept_rows[segments.clamp(min=0), patch_index] & (segments >= 0)
    length = min(n, keep.shape[1] + images_per_sequence)
    order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)[:, :length]
    pixels = pixels.gather(1, order.view(*order.shape, *(1,) * (pixels.dim() - 2)).expand(-1, -1, *pixels.shape[2:]))
    segments = torch.where(kept.gather(1, order), segments.gather(1, order), -1)
    return pixels, segments, patch_index.gather(1, order)


def unpack(values: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """[S, N, ...] packed -> [rows, N, ...] padded: one row per image, its patches first
    (``places`` from :func:`packed_places`)."""
    return values.flatten(0, 1)[places]


def kept_patches(draw: torch.Tensor, real: torch.Tensor | None, fraction: float) -> torch.Tensor:
    """The patches each row keeps under patch dropout: int64 [B, K], ascending, K = N - floor(fraction
    * N) for ``draw`` [B, N] (uniform numbers, one per position).

    Each image keeps the ``r - floor(fraction * r)`` of its ``r`` real patches (``real`` [B, N]; None:
    all N are) with the smallest draws. An image with fewer real patches fills the rest of its K with
    padding positions, which stay masked: there are always enough, since r - floor(fraction * r)
    grows by at most one with r. Stable sorts: ties fall to the lower position, on any device."""
    n = draw.shape[1]
    width = n - math.floor(fraction * n)
    if real is None:
        order = torch.argsort(draw, dim=1, stable=True)
    else:
        count = real.sum(dim=1)
        keeps = count - torch.floor(fraction * count.double()).long()
        ranked = torch.where(real, draw, 2.0)
        rank = torch.argsort(torch.argsort(ranked, dim=1, stable=True), dim=1, stable=True)
        kept = real & (rank < keeps[:, None])
        # kept real patches first, then padding (masked), then the dropped real ones
        order = torch.argsort(torch.where(kept, draw, torch.where(real, 3.0, 2.0)), dim=1, stable=True)
    return torch.sort(order[:, :width], dim=1).values
