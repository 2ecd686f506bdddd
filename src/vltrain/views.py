"""Random crops of a batch's images, resized to one square size (:func:`views`), and an exact-count
patch mask (:func:`patch_mask`): the views SigLIP 2's self-distillation (SILC: the EMA teacher sees
one global view, the student small local ones) and masked prediction (TIPS: half the student's
patches of the global view masked) are made of.

Nothing here draws: the caller passes uniform numbers in [0, 1) it drew keyed by (seed, step, sample
id) (``StepKey.uniform`` with ``Stream.GLOBAL_VIEW``, ``LOCAL_VIEW``, ``VIEW_MASK``), so a sample
gets the same views in step s on whichever rank and micro-batch it lands, as the objectives' masks
do. A crop is RandomResizedCrop's (an area fraction, a log-uniform aspect ratio, a position),
except that it is never redrawn: a crop too wide or too tall for its image is narrowed to fit with
its area kept, so each crop takes a fixed number of uniforms (:data:`UNIFORMS_PER_CROP`).

The resize is Pillow's bilinear filter, widened when shrinking (the antialiasing torch's
``F.interpolate(..., antialias=True)`` ports from it), written as one weight matrix per axis and
crop: every crop of the batch is resized by two batched matrix products, with no loop over crops,
any box (fractional ones too) and any image size. Per-crop ``F.interpolate`` calls would be a
host loop of B x V small kernels in every step.

It sits in the bottom layer, beside ``images.py``: it takes and returns :class:`Images`, and the
step that will call it imports it from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vltrain.images import Images

UNIFORMS_PER_CROP = 5
"""The uniforms one crop reads, by index in its last dimension: 0 its area fraction, 1 its
(log) aspect ratio, 2 its left edge, 3 its top edge, 4 whether it is flipped."""


@dataclass(frozen=True)
class CropRange:
    """What a view's crop may be: RandomResizedCrop's ranges and its output size."""

    size: int
    """The view's side in pixels (square): a whole number of patches (:func:`views` checks it)."""
    scale: tuple[float, float]
    """The range of the crop's area, as a fraction of its image's, drawn uniformly: within (0, 1]."""
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    """The range of the crop's aspect ratio (width / height), drawn uniformly in its logarithm."""
    flip: bool = True
    """Flip half the crops left to right."""

    def __post_init__(self):
        low, high = self.scale
        if not 0 < low <= high <= 1:
            raise ValueError(f"crop scale {self.scale} is not a range within (0, 1]: give (min, max) area fractions")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"crop ratio {self.ratio} is not a range of positive aspect ratios (min, max)")
        if self.size < 1:
            raise ValueError(f"crop size {self.size} must be a positive number of pixels")


class Crops(NamedTuple):
    """Where each view is cut from its image, and whether it is flipped."""

    boxes: torch.Tensor
    """float32 [B, V, 4]: x0, y0, x1, y1 in pixels of the image (x by its width, y by its height),
    pixel k covering [k, k + 1): continuous, not rounded, as Pillow's ``resize(box=...)`` takes them."""
    flipped: torch.Tensor
    """bool [B, V]: the view is flipped left to right after the resize."""


def crop_boxes(uniforms: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor, crop: CropRange) -> Crops:
    """The crops of ``uniforms`` [B, V, :data:`UNIFORMS_PER_CROP`] in images of ``heights`` x
    ``widths`` [B] pixels: V crops of each image.

    A crop's area is ``scale`` of its image's (uniform 0 over ``crop.scale``) and its aspect ratio
    ``exp`` of uniform 1 over the log of ``crop.ratio``. Where that is wider (taller) than the
    image, the crop takes the image's whole width (height) and the height (width) that keeps its
    area: its area fraction always lies in ``crop.scale``, only its aspect ratio gives. Its left and
    top edges are uniforms 2 and 3 of the room left; it is flipped where uniform 4 < 1/2 (and
    ``crop.flip``)."""
    if uniforms.dim() != 3 or uniforms.shape[-1] != UNIFORMS_PER_CROP:
        raise ValueError(f"uniforms of shape {tuple(uniforms.shape)}: give [B, V, {UNIFORMS_PER_CROP}] (UNIFORMS_PER_CROP)")
    u = uniforms.float()
    height = heights.to(u.device, torch.float32)[:, None]
    width = widths.to(u.device, torch.float32)[:, None]
    low, high = crop.scale
    area = (low + u[..., 0] * (high - low)) * height * width
    log_low, log_high = math.log(crop.ratio[0]), math.log(crop.ratio[1])
    aspect = torch.exp(log_low + u[..., 1] * (log_high - log_low))
    w = torch.minimum(torch.sqrt(area * aspect), width)
    h = torch.minimum(area / w, height)
    w = torch.minimum(area / h, width)
    x0 = u[..., 2] * (width - w)
    y0 = u[..., 3] * (height - h)
    boxes = torch.stack([x0, y0, torch.minimum(x0 + w, width), torch.minimum(y0 + h, height)], dim=-1)
    flipped = (u[..., 4] < 0.5) & crop.flip
    return Crops(boxes, flipped)


def views(images: Images, uniforms: torch.Tensor, crop: CropRange, patch_size: int) -> Images:
    """V views of each image: each the crop of :func:`crop_boxes` (``uniforms`` [B, V,
    :data:`UNIFORMS_PER_CROP`]) resized to ``crop.size`` x ``crop.size`` (bilinear, antialiased when
    shrinking: Pillow's filter), then flipped if drawn.

    ``images`` in any layout (square, padded, packed: each image at its own size); returns them
    square, B x V rows, row i's views at rows i * V .. i * V + V - 1, in the pixels' dtype (uint8
    rounded, a float dtype as it is: a training step's normalized pixels). The views carry no
    regions and see every patch (``keep`` is not theirs)."""
    if crop.size % patch_size:
        raise ValueError(f"crop size {crop.size} is not a whole number of {patch_size}-pixel patches: "
                         f"make it a multiple of {patch_size}")
    if uniforms.dim() != 3 or uniforms.shape[0] != len(images):
        raise ValueError(f"uniforms of shape {tuple(uniforms.shape)} for {len(images)} images: give "
                         f"[{len(images)}, V, {UNIFORMS_PER_CROP}]")
    pixels, heights, widths = _canvas(images, patch_size)
    boxes, flipped = crop_boxes(uniforms, heights, widths, crop)
    work = torch.promote_types(pixels.dtype, torch.float32) if pixels.is_floating_point() else torch.float32
    x0, y0, x1, y1 = boxes.to(work).unbind(-1)
    down = _resize_weights(y0, y1, heights, crop.size, pixels.shape[-2])  # [B, V, S, H]
    across = _resize_weights(x0, x1, widths, crop.size, pixels.shape[-1])  # [B, V, S, W]
    across = torch.where(flipped[..., None, None], across.flip(-2), across)
    rows = torch.einsum("bvsh,bchw->bvcsw", down, pixels.to(work))
    out = torch.einsum("bvcsw,bvtw->bvcst", rows, across).flatten(0, 1)
    if not pixels.is_floating_point():
        info = torch.iinfo(pixels.dtype)
        out = out.round().clamp(info.min, info.max)
    return Images(out.to(pixels.dtype).contiguous())


def patch_mask(uniforms: torch.Tensor, ratio: float, real: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B, N]: which patch positions are masked, given ``uniforms`` [B, N] (one per position)
    and ``real`` [B, N] (which positions hold a patch; None: all do, a square image's).

    Each image masks exactly ``round(ratio * r)`` of its ``r`` real patches (half to even, as
    Python's ``round``), those with the smallest uniforms (ties to the lower position), and no
    padding: a count, not a coin per patch, so every image hides the same share (TIPS masks half
    the student's patches of the global view). One sort of the batch, no loop over rows."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"mask ratio {ratio} must lie in [0, 1]")
    if real is None:
        real = torch.ones_like(uniforms, dtype=torch.bool)
    count = torch.round(ratio * real.sum(dim=1, dtype=torch.float64)).long()
    order = torch.argsort(torch.where(real, uniforms.float(), 2.0), dim=1, stable=True)  # padding last
    first = torch.arange(uniforms.shape[1], device=uniforms.device) < count[:, None]
    return torch.zeros_like(real).scatter_(1, order, first) & real


def _canvas(images: Images, patch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, 3, H, W] each image in its top-left corner (zeros past it), its height and width [B].

    Square images are the canvas. Others are laid out from their patches (packed ones unpacked
    first) on a canvas of the batch's largest grid, read from the device: one host sync."""
    if images.layout == "square":
        pixels = images.pixels
        b, _, h, w = pixels.shape
        full = torch.ones(b, dtype=torch.int64, device=pixels.device)
        return pixels, full * h, full * w
    images = images.unpacked()
    p, grids, patches = patch_size, images.grids, images.pixels
    if patches.shape[-1] != 3 * p * p:
        raise ValueError(f"patches of {patches.shape[-1]} values are not 3 x {p} x {p}: pass the patch size they were cut at")
    most_rows, most_cols = grids.amax(dim=0).tolist()
    r = torch.arange(most_rows, device=grids.device)[None, :, None]
    c = torch.arange(most_cols, device=grids.device)[None, None, :]
    rows, cols = grids[:, 0, None, None], grids[:, 1, None, None]
    inside = ((r < rows) & (c < cols)).flatten(1)  # [B, R * C]
    index = torch.where(inside, (r * cols + c).flatten(1), 0)
    placed = patches.gather(1, index[..., None].expand(-1, -1, patches.shape[-1]))
    placed = placed.masked_fill(~inside[..., None], 0)
    canvas = placed.view(len(grids), most_rows, most_cols, 3, p, p).permute(0, 3, 1, 4, 2, 5)
    canvas = canvas.reshape(len(grids), 3, most_rows * p, most_cols * p)
    return canvas, grids[:, 0] * p, grids[:, 1] * p


def _resize_weights(start: torch.Tensor, end: torch.Tensor, extent: torch.Tensor, size: int, length: int
                    ) -> torch.Tensor:
    """[B, V, size, length]: how much each of an axis's ``length`` pixels weighs in each of ``size``
    output pixels, resizing [start, end) [B, V] of an image ``extent`` [B] pixels long on that axis.

    Pillow's bilinear resample with a box (``precompute_coeffs``): output pixel i is centred at
    ``start + (i + 0.5) * scale`` (scale = (end - start) / size) and weighs pixel j by the triangle
    ``1 - |j + 0.5 - centre| / max(scale, 1)``, over the image's pixels only, normalized to sum 1.
    The triangle widens with the scale when shrinking: the antialiasing."""
    scale = (end - start) / size
    step = torch.arange(size, device=start.device, dtype=start.dtype) + 0.5
    centre = start[..., None] + step * scale[..., None]  # [B, V, size]
    pixel = torch.arange(length, device=start.device, dtype=start.dtype) + 0.5
    weights = (1 - (pixel - centre[..., None]).abs() / scale.clamp(min=1)[..., None, None]).clamp(min=0)
    on_image = torch.arange(length, device=start.device) < extent.to(start.device)[:, None, None, None]
    weights = weights * on_image
    return weights / weights.sum(dim=-1, keepdim=True)
