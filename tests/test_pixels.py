"""The shared pixel conventions: one patch order for the loader, the tower and the MIM targets, and
one table of resampling filters for Pillow, ``data.interpolation`` and Hugging Face processors."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from vltrain.data.loading.packing import layout
from vltrain.pixels import INTERPOLATIONS, RESAMPLE, packed_places, patchify, resample_code, resample_name, unpack


def test_patches_are_in_the_order_of_a_patch_embedding_convolution():
    torch.manual_seed(0)
    chw = torch.randint(0, 256, (3, 32, 48), dtype=torch.uint8)
    conv = torch.nn.Conv2d(3, 5, kernel_size=16, stride=16, bias=False).double()
    by_conv = conv(chw.double()[None])[0].flatten(1).T  # [rows * cols, 5], row-major grid
    by_patches = patchify(chw, 16).double() @ conv.weight.flatten(1).T
    torch.testing.assert_close(by_patches, by_conv)


def test_one_image_and_a_batch_are_cut_as_the_three_copies_cut_them():
    """The formulas the loader (one [3, H, W] image) and the tower and MIM loss ([B, 3, H, W]) each
    had: equal values, shape and strides, so what follows computes the same numbers."""
    torch.manual_seed(0)
    chw = torch.randint(0, 256, (3, 32, 48), dtype=torch.uint8)
    c, h, w, p = 3, 32, 48, 16
    loader = chw.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape((h // p) * (w // p), c * p * p)
    got = patchify(chw, p)
    assert torch.equal(got, loader) and got.stride() == loader.stride()
    batch = torch.randn(4, 3, 32, 48)
    b = 4
    tower = batch.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
    got = patchify(batch, p)
    assert torch.equal(got, tower) and got.stride() == tower.stride()
    assert torch.equal(got[1], patchify(batch[1], p))


def test_patchify_refuses_a_partial_patch():
    with pytest.raises(ValueError, match="16-pixel patches"):
        patchify(torch.zeros(3, 20, 32, dtype=torch.uint8), 16)


def test_the_filter_codes_are_pillows():
    """Pillow's classic six (0-5, what transformers' processors take); newer Pillows add more."""
    assert RESAMPLE == {m.name.lower(): int(m) for m in Image.Resampling if m <= 5}
    assert set(INTERPOLATIONS) <= set(RESAMPLE)


def test_a_filter_is_named_or_given_by_its_code():
    assert resample_code("bicubic") == resample_code("BiCubic") == resample_code(3) == 3
    assert resample_code("bilinear") == 2 and resample_code(0) == 0
    for bad in ("cubic", 7, -1, True, 2.0, None):
        with pytest.raises(ValueError, match="unknown resample"):
            resample_code(bad)
    assert [resample_name(c) for c in (2, 3, 1)] == ["bilinear", "bicubic", "lanczos"]
    assert resample_name(9) is None and resample_name(True) is None and resample_name("2") is None


def test_a_packed_batch_unpacks_to_each_images_patches_in_order():
    sizes = [6, 0, 3, 7, 2, 5]  # row 1 has no image
    length = 8
    padded = torch.zeros(len(sizes), length, 2)
    for i, n in enumerate(sizes):
        padded[i, :n, 0], padded[i, :n, 1] = i, torch.arange(n)  # (row, patch)
    places, segments, patch_index = layout(sizes, length)
    packed = torch.full((segments.shape[0], length, 2), -1.0)
    for i, (seq, offset) in enumerate(places):
        packed[seq, offset:offset + sizes[i]] = padded[i, :sizes[i]]
    assert segments.shape[0] == 3  # 7 | 6 + 2 | 5 + 3: really packed
    out = unpack(packed, packed_places(segments, patch_index, len(sizes)))
    assert out.shape == padded.shape
    real = torch.arange(length) < torch.tensor(sizes)[:, None]
    assert torch.equal(out[real], padded[real])
    assert (out[~real] >= 0).all()  # past a row's patches: some image's patch, never the packing's padding
