"""The views of self-distillation and masked prediction: crops as Pillow resizes their boxes, the same
views for the same uniforms in every layout, flips that flip, and masks of an exact count."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vltrain.data.loading.packing import class_slots, layout
from vltrain.images import Images
from vltrain.objectives.keyed import Stream, StepKey
from vltrain.pixels import patchify
from vltrain.views import UNIFORMS_PER_CROP, CropRange, crop_boxes, patch_mask, views

P = 8


def close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    """``got`` within ``atol + rtol * |want|`` of ``want``, everywhere (torch.testing's first call
    costs more than this file's tests)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.double() - want.double()).abs()
    assert (err <= atol + rtol * want.double().abs()).all(), f"off by up to {err.max().item()}"


def photo(height: int, width: int, seed: int = 0) -> torch.Tensor:
    """float32 [3, height, width] in [0, 1]: smooth colour fields with a sharp diagonal edge, so a
    resize that skips antialiasing or shifts by a pixel shows."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, height // 8 + 2, width // 8 + 2, generator=g)
    smooth = F.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)[0]
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    edge = ((x + 2 * y) % 23 < 7).float()
    return (0.7 * smooth + 0.3 * edge).clamp(0, 1)


def pillow_view(chw: torch.Tensor, box: list[float], size: int, flipped: bool) -> torch.Tensor:
    """Pillow's bilinear resize of ``box`` of a float [3, H, W] image ("F" mode) or a uint8 one (RGB)."""
    if chw.dtype == torch.uint8:
        im = Image.fromarray(chw.permute(1, 2, 0).numpy(), mode="RGB")
        out = torch.from_numpy(np.array(im.resize((size, size), Image.BILINEAR, box=tuple(box)))).permute(2, 0, 1)
    else:
        bands = [Image.fromarray(c.numpy(), mode="F").resize((size, size), Image.BILINEAR, box=tuple(box)) for c in chw]
        out = torch.from_numpy(np.stack([np.array(b) for b in bands]))
    return out.flip(-1) if flipped else out


def test_each_view_is_pillows_bilinear_resize_of_its_box_shrunk_or_grown():
    image = photo(72, 104)
    uniforms = torch.rand(1, 6, UNIFORMS_PER_CROP, generator=torch.Generator().manual_seed(1))
    for crop in (CropRange(size=32, scale=(0.3, 1.0)), CropRange(size=48, scale=(0.02, 0.1))):
        got = views(Images(image[None]), uniforms, crop, P)
        boxes, flipped = crop_boxes(uniforms, torch.tensor([72]), torch.tensor([104]), crop)
        assert got.layout == "square" and got.pixels.shape == (6, 3, crop.size, crop.size)
        assert flipped.any() and not flipped.all()
        for v in range(6):
            want = pillow_view(image, boxes[0, v].tolist(), crop.size, bool(flipped[0, v]))
            close(got.pixels[v], want, atol=2e-5)


def test_uint8_views_stay_uint8_and_round_as_pillow_does():
    """Pillow rounds to a level between its two passes, so a level apart at most."""
    image = (photo(64, 48, seed=2) * 255).round().to(torch.uint8)
    uniforms = torch.rand(1, 4, UNIFORMS_PER_CROP, generator=torch.Generator().manual_seed(3))
    crop = CropRange(size=24, scale=(0.2, 0.9))
    got = views(Images(image[None]), uniforms, crop, P)
    assert got.pixels.dtype == torch.uint8
    boxes, flipped = crop_boxes(uniforms, torch.tensor([64]), torch.tensor([48]), crop)
    for v in range(4):
        want = pillow_view(image, boxes[0, v].tolist(), crop.size, bool(flipped[0, v]))
        assert (got.pixels[v].int() - want.int()).abs().max() <= 1


def test_a_whole_pixel_box_is_torchs_antialiased_interpolate_of_the_cut_pixels():
    """The filter is the one ``F.interpolate(..., antialias=True)`` has: on a box of whole pixels they agree."""
    image = photo(60, 60, seed=4)
    crop = CropRange(size=16, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False)
    got = views(Images(image[None]), torch.zeros(1, 1, UNIFORMS_PER_CROP), crop, P).pixels[0]
    want = F.interpolate(image[None], size=(16, 16), mode="bilinear", antialias=True, align_corners=False)[0]
    close(got, want, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_a_whole_image_crop_at_its_own_size_is_the_image(dtype):
    image = photo(32, 32, seed=5)
    image = (image * 255).round().to(dtype) if dtype == torch.uint8 else image
    crop = CropRange(size=32, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    uniforms = torch.rand(2, 3, UNIFORMS_PER_CROP, generator=torch.Generator().manual_seed(6))
    uniforms[..., 4] = 0.75  # not flipped
    got = views(Images(torch.stack([image, image.flip(0)])), uniforms, crop, P)
    assert got.pixels.dtype == dtype
    assert torch.equal(got.pixels[:3], image.expand(3, -1, -1, -1))
    assert torch.equal(got.pixels[3:], image.flip(0).expand(3, -1, -1, -1))


def test_the_same_uniforms_give_the_same_views_and_others_other_views():
    images = Images(torch.stack([photo(40, 40, seed=s) for s in range(3)]))
    crop = CropRange(size=16, scale=(0.05, 0.4))
    key = StepKey(seed=7, step=11)
    ids = torch.tensor([5, 9, 2])
    uniforms = key.uniform(Stream.LOCAL_VIEW, ids, 4 * UNIFORMS_PER_CROP).view(3, 4, UNIFORMS_PER_CROP)
    first = views(images, uniforms, crop, P).pixels
    again = views(images, key.uniform(Stream.LOCAL_VIEW, ids, 4 * UNIFORMS_PER_CROP).view(3, 4, -1), crop, P).pixels
    assert torch.equal(first, again)
    other = StepKey(seed=7, step=12).uniform(Stream.LOCAL_VIEW, ids, 4 * UNIFORMS_PER_CROP).view(3, 4, -1)
    changed = (views(images, other, crop, P).pixels - first).flatten(1).abs().amax(dim=1)
    assert (changed > 0.01).all()
    # rows in order: image i's views at rows i * V .. i * V + V - 1
    alone = views(images[1:2], uniforms[1:2], crop, P).pixels
    close(first[4:8], alone, atol=1e-6)


def test_the_view_streams_are_new_streams():
    taken = [v for name, v in vars(Stream).items() if name.isupper()]
    assert (Stream.GLOBAL_VIEW, Stream.LOCAL_VIEW, Stream.VIEW_MASK) == (13, 14, 15)
    assert len(set(taken)) == len(taken)


def test_a_flipped_view_is_the_unflipped_one_mirrored():
    image = photo(48, 40, seed=8)
    uniforms = torch.rand(1, 1, UNIFORMS_PER_CROP, generator=torch.Generator().manual_seed(9)).repeat(1, 2, 1)
    uniforms[0, 0, 4], uniforms[0, 1, 4] = 0.9, 0.1
    got = views(Images(image[None]), uniforms, CropRange(size=16, scale=(0.3, 0.6)), P).pixels
    assert not torch.allclose(got[0], got[1], atol=0.01)
    close(got[1], got[0].flip(-1), atol=1e-6)
    unflipped = views(Images(image[None]), uniforms, CropRange(size=16, scale=(0.3, 0.6), flip=False), P).pixels
    close(unflipped[1], got[0], atol=1e-6)


def padded_and_packed(images: list[torch.Tensor], length: int) -> tuple[Images, Images]:
    """The same images at their own shape, padded to ``length`` patches, and packed."""
    grids = torch.tensor([[im.shape[1] // P, im.shape[2] // P] for im in images])
    padded = torch.zeros(len(images), length, 3 * P * P, dtype=images[0].dtype)
    for i, im in enumerate(images):
        padded[i, :im.shape[1] // P * im.shape[2] // P] = patchify(im, P)
    sizes = [int(r * c) for r, c in grids]
    places, segments, patch_index = layout(sizes, length)
    packed = torch.zeros(segments.shape[0], length, 3 * P * P, dtype=images[0].dtype)
    for i, ((seq, offset), n) in enumerate(zip(places, sizes)):
        packed[seq, offset:offset + n] = padded[i, :n]
    slots = class_slots(places, sizes, segments.shape[0])
    return Images(padded, grids), Images(packed, grids, segments, patch_index, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_padded_and_packed_images_give_the_views_they_give_square(dtype):
    shapes = [(24, 40), (40, 16), (8, 8), (32, 32)]
    images = [photo(h, w, seed=i) for i, (h, w) in enumerate(shapes)]
    if dtype == torch.uint8:
        images = [(im * 255).round().to(dtype) for im in images]
    uniforms = torch.rand(4, 3, UNIFORMS_PER_CROP, generator=torch.Generator().manual_seed(10))
    crop = CropRange(size=16, scale=(0.2, 1.0))
    square = torch.cat([views(Images(im[None]), uniforms[i:i + 1], crop, P).pixels for i, im in enumerate(images)])
    padded, packed = padded_and_packed(images, length=20)
    assert packed.layout == "packed" and packed.pixels.shape[0] < 4
    for other in (padded, packed):
        got = views(other, uniforms, crop, P)
        assert got.layout == "square" and got.pixels.dtype == dtype
        close(got.pixels, square, atol=1e-6 if dtype.is_floating_point else 0)


def test_boxes_lie_in_their_image_with_the_drawn_area_and_aspect_ratio_where_it_fits():
    n = 4000
    uniforms = torch.rand(n, 1, UNIFORMS_PER_CROP, generator=torch.Generator().manual_seed(11))
    uniforms[:8, 0, :4] = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.999, 0.999, 0.999, 0.999]]).repeat(4, 1)
    heights = torch.randint(8, 600, (n,), generator=torch.Generator().manual_seed(12))
    widths = torch.randint(8, 600, (n,), generator=torch.Generator().manual_seed(13))
    heights[:4], widths[:4] = 10, 500  # far wider than any crop's aspect ratio
    crop = CropRange(size=32, scale=(0.25, 0.8), ratio=(3 / 4, 4 / 3))
    boxes, _ = crop_boxes(uniforms, heights, widths, crop)
    x0, y0, x1, y1 = boxes[:, 0].double().unbind(-1)
    h, w = heights.double(), widths.double()
    assert (x0 >= 0).all() and (y0 >= 0).all() and (x1 <= w).all() and (y1 <= h).all()
    fraction = (x1 - x0) * (y1 - y0) / (h * w)
    assert fraction.min() >= 0.25 - 1e-5 and fraction.max() <= 0.8 + 1e-5
    u = uniforms[:, 0].double()
    area = (0.25 + u[:, 0] * 0.55) * h * w
    aspect = torch.exp(math.log(3 / 4) + u[:, 1] * math.log(16 / 9))
    drawn_w, drawn_h = torch.sqrt(area * aspect), torch.sqrt(area / aspect)
    fits = (drawn_w <= w) & (drawn_h <= h)
    assert 0.3 < fits.float().mean() < 0.95 and not fits[:4].any()
    close((x1 - x0)[fits], drawn_w[fits], rtol=1e-4, atol=1e-3)
    close((y1 - y0)[fits], drawn_h[fits], rtol=1e-4, atol=1e-3)
    # a crop that does not fit spans its image's width or height, with the area drawn
    spans = ((x1 - x0 - w).abs() < 1e-3) | ((y1 - y0 - h).abs() < 1e-3)
    assert spans[~fits].all()
    close(((x1 - x0) * (y1 - y0))[~fits], area[~fits], rtol=1e-4, atol=1e-3)
    # placed by uniforms 2 and 3 in the room left
    close(x0, u[:, 2] * (w - (x1 - x0)), rtol=1e-4, atol=1e-3)
    close(y0, u[:, 3] * (h - (y1 - y0)), rtol=1e-4, atol=1e-3)


def test_the_crop_range_and_the_patch_size_are_checked():
    with pytest.raises(ValueError, match="multiple of 16"):
        views(Images(torch.zeros(1, 3, 32, 32)), torch.zeros(1, 1, UNIFORMS_PER_CROP), CropRange(24, (0.5, 1.0)), 16)
    with pytest.raises(ValueError, match="within"):
        CropRange(32, (0.0, 1.0))
    with pytest.raises(ValueError, match="UNIFORMS_PER_CROP"):
        crop_boxes(torch.zeros(1, 1, 4), torch.tensor([32]), torch.tensor([32]), CropRange(32, (0.5, 1.0)))


def test_a_patch_mask_masks_an_exact_count_of_real_patches_with_the_smallest_uniforms():
    g = torch.Generator().manual_seed(14)
    uniforms = torch.rand(6, 20, generator=g)
    counts = torch.tensor([20, 13, 1, 7, 0, 5])
    real = torch.arange(20) < counts[:, None]
    for ratio in (0.5, 0.3, 0.0, 1.0):
        mask = patch_mask(uniforms, ratio, real)
        assert not (mask & ~real).any()
        for i, r in enumerate(counts.tolist()):
            k = round(ratio * r)
            assert int(mask[i].sum()) == k
            smallest = torch.argsort(uniforms[i, :r])[:k]
            assert set(mask[i].nonzero().flatten().tolist()) == set(smallest.tolist())
    square = patch_mask(uniforms, 0.5, None)
    assert (square.sum(dim=1) == 10).all()
    assert torch.equal(square, patch_mask(uniforms, 0.5, torch.ones(6, 20, dtype=torch.bool)))
    assert torch.equal(patch_mask(uniforms, 0.5, None), square)  # the same uniforms, the same mask


def test_a_patch_mask_is_a_count_not_a_coin_per_patch():
    """A Bernoulli(1/2) draw would mask between 0 and 16 of 16 patches; every row masks 8 here."""
    uniforms = torch.rand(200, 16, generator=torch.Generator().manual_seed(15))
    assert (patch_mask(uniforms, 0.5).sum(dim=1) == 8).all()
    assert not (((uniforms < 0.5).sum(dim=1)) == 8).all()
    assert int(patch_mask(uniforms[:1, :13], 0.5).sum()) == 6
