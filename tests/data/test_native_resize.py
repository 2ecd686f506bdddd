import io
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from transformers.models.siglip2.image_processing_pil_siglip2 import (
    Siglip2ImageProcessorPil,
    get_image_size_for_max_num_patches,
)

from vltrain.data.images import ImageError
from vltrain.data.native import decode_native, native_grid

ASPECTS = [(1, 4), (1, 2), (1, 1), (2, 1), (4, 1)]  # height : width
LONG_SIDES = [40, 300, 900]


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def shape(aspect: tuple[int, int], long_side: int) -> tuple[int, int]:
    """(height, width) with the given aspect and the longer side ``long_side``."""
    h, w = aspect
    return long_side * h // max(h, w), long_side * w // max(h, w)


def picture(height: int, width: int, kind: str, seed: int = 0) -> Image.Image:
    """Random noise (the hardest case for a resampler) or a smooth colour gradient, RGB."""
    if kind == "noise":
        a = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        y, x = np.mgrid[0:height, 0:width]
        a = np.stack([255 * x // max(width - 1, 1), 255 * y // max(height - 1, 1), (x + y) % 256], -1)
    return Image.fromarray(a.astype(np.uint8), "RGB")


def grid_sizes() -> list[tuple[int, int]]:
    sizes = [shape(a, s) for a in ASPECTS for s in LONG_SIDES]
    sizes += [(1, 4000), (4000, 1), (16, 16), (7, 7), (1, 1)]
    rng = random.Random(0)
    sizes += [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(150)]
    return sizes


@pytest.mark.parametrize("patch", [16, 14])
@pytest.mark.parametrize("budget", [64, 256, 1024])
def test_grid_equals_transformers(patch, budget):
    for h, w in grid_sizes():
        th, tw = get_image_size_for_max_num_patches(h, w, patch, budget)
        assert native_grid(h, w, patch, budget) == (th // patch, tw // patch), (h, w)


@pytest.mark.parametrize("budget", [64, 256, 1024])
def test_grid_is_within_budget_and_keeps_the_aspect(budget):
    for h, w in grid_sizes():
        rows, cols = native_grid(h, w, 16, budget)
        assert 1 <= rows * cols <= budget
        # One scale s fits both sides: each is h*s (w*s) rounded up to whole patches.
        low = max((rows - 1) * 16 / h, (cols - 1) * 16 / w)
        assert low < min(rows * 16 / h, cols * 16 / w), (h, w, rows, cols)


def hf_patches(processor: Siglip2ImageProcessorPil, im: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
    """The processor's valid (unpadded) patch rows and its grid."""
    out = processor(images=[im], return_tensors="np")
    n = int(out["pixel_attention_mask"][0].sum())
    return out["pixel_values"][0, :n], tuple(int(v) for v in out["spatial_shapes"][0])


def normalized_like_hf(patches: torch.Tensor, patch: int) -> np.ndarray:
    """Our uint8 (c, y, x) patches as HF lays them out and scales them: (y, x, c), (x/255 - 0.5) / 0.5."""
    yxc = patches.view(-1, 3, patch, patch).permute(0, 2, 3, 1).reshape(len(patches), -1).numpy()
    scaled = (yxc.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (scaled - np.float32(0.5)) / np.float32(0.5)


def test_processor_is_the_pil_backend_with_bilinear():
    processor = Siglip2ImageProcessorPil(patch_size=16, max_num_patches=256)
    assert processor.backend == "pil" and processor.resample == Image.Resampling.BILINEAR


@pytest.mark.parametrize("kind", ["noise", "gradient"])
@pytest.mark.parametrize("long_side", LONG_SIDES)
@pytest.mark.parametrize("aspect", ASPECTS, ids=lambda a: f"{a[0]}to{a[1]}")
def test_pixels_equal_transformers(aspect, long_side, kind):
    im = picture(*shape(aspect, long_side), kind, seed=long_side)
    patches, grid = decode_native(encode(im), 16, 256)
    want, want_grid = hf_patches(Siglip2ImageProcessorPil(patch_size=16, max_num_patches=256), im)
    assert grid == want_grid
    assert patches.dtype == torch.uint8 and patches.shape == (grid[0] * grid[1], 3 * 16 * 16)
    np.testing.assert_allclose(normalized_like_hf(patches, 16), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("resample", [3, "lanczos"])
def test_other_filters_equal_transformers(resample):
    im = picture(300, 170, "noise", seed=1)
    patches, grid = decode_native(encode(im), 14, 64, resample=resample)
    code = resample if isinstance(resample, int) else Image.Resampling.LANCZOS
    processor = Siglip2ImageProcessorPil(patch_size=14, max_num_patches=64, resample=code)
    want, want_grid = hf_patches(processor, im)
    assert grid == want_grid
    np.testing.assert_allclose(normalized_like_hf(patches, 14), want, rtol=0, atol=1e-6)


def test_exif_rotated_jpeg_equals_transformers_on_the_upright_image():
    # Stored 200 wide x 60 high, tagged "rotate 90 CW" (orientation 6): displayed 60 wide x 200 high.
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(picture(60, 200, "gradient"), "JPEG", quality=90, exif=exif.tobytes())
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert upright.size == (60, 200)
    patches, grid = decode_native(data, 16, 256)
    want, want_grid = hf_patches(Siglip2ImageProcessorPil(patch_size=16, max_num_patches=256), upright)
    assert grid == want_grid and grid[0] > grid[1]  # taller than wide, as displayed
    np.testing.assert_allclose(normalized_like_hf(patches, 16), want, rtol=0, atol=1e-6)


def test_no_upscale_keeps_a_small_image_at_its_own_size():
    im = picture(40, 30, "noise")  # 40 high, 30 wide
    expected = (math.ceil(40 / 16), math.ceil(30 / 16))  # (3, 2): 48 x 32 pixels, barely enlarged
    patches, grid = decode_native(encode(im), 16, 256, upscale=False)
    assert grid == expected == (3, 2) and patches.shape == (6, 768)
    assert decode_native(encode(im), 16, 256)[1] == native_grid(40, 30, 16, 256) != expected


def test_no_upscale_still_shrinks_an_image_over_the_budget():
    assert native_grid(40, 30, 16, 4, upscale=False) == native_grid(40, 30, 16, 4) == (2, 2)
    assert native_grid(900, 450, 16, 256, upscale=False) == native_grid(900, 450, 16, 256)


def test_min_patches_lifts_a_tiny_image():
    assert native_grid(8, 8, 16, 256, upscale=False) == (1, 1)
    assert native_grid(8, 8, 16, 256, min_patches=4, upscale=False) == (2, 2)
    assert native_grid(8, 8, 16, 256, min_patches=5, upscale=False) == (3, 3)  # square: k x k only
    assert native_grid(8, 8, 16, 8, min_patches=5, upscale=False) == (2, 2)  # 3 x 3 is over the budget
    assert native_grid(8, 16, 16, 256, min_patches=6, upscale=False) == (2, 3)
    patches, grid = decode_native(encode(picture(8, 8, "noise")), 16, 256, min_patches=4, upscale=False)
    assert grid == (2, 2) and patches.shape == (4, 768)


def test_a_one_pixel_high_line_gives_one_row_within_the_budget():
    line = picture(1, 4000, "gradient")
    patches, (rows, cols) = decode_native(encode(line), 16, 256)
    assert rows == 1 and 1 < cols <= 256 and patches.shape == (cols, 768)
    red = patches.view(cols, 3, 16, 16)[:, 0]  # red runs 0 -> 255 left to right
    assert red[0].float().mean() < 10 and red[-1].float().mean() > 245
    _, (rows, cols) = decode_native(encode(picture(4000, 1, "gradient")), 16, 256)
    assert cols == 1 and 1 < rows <= 256


def test_a_one_patch_image_fills_the_budget_only_when_upscaling():
    im = picture(16, 16, "noise")
    assert decode_native(encode(im), 16, 256)[1] == (16, 16)
    patches, grid = decode_native(encode(im), 16, 256, upscale=False)
    assert grid == (1, 1)
    assert torch.equal(patches[0], torch.from_numpy(np.array(im)).permute(2, 0, 1).flatten())


def test_resample_accepts_names_and_pillow_codes():
    data = encode(picture(50, 70, "noise"))
    assert torch.equal(decode_native(data, 16, 16, resample="bicubic")[0], decode_native(data, 16, 16, resample=3)[0])
    assert not torch.equal(decode_native(data, 16, 16, resample="nearest")[0], decode_native(data, 16, 16)[0])
    with pytest.raises(ValueError, match="unknown resample"):
        decode_native(data, 16, 16, resample="cubic")
    with pytest.raises(ValueError, match="unknown resample"):
        decode_native(data, 16, 16, resample=7)


def test_an_image_over_max_pixels_is_refused_from_its_header():
    with pytest.raises(ImageError, match="data.max_image_pixels"):
        decode_native(encode(picture(100, 100, "noise")), 16, 256, max_pixels=5000)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "empty file"),
        (b"not an image at all", "not an image"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "cannot decode|not an image"),
    ],
    ids=["empty", "garbage", "broken-png"],
)
def test_unusable_bytes_raise_image_error(data, reason):
    with pytest.raises(ImageError, match=reason):
        decode_native(data, 16, 256)


def test_truncated_image_raises_image_error():
    data = encode(picture(300, 300, "noise"))
    with pytest.raises(ImageError, match="cannot decode"):
        decode_native(data[: len(data) // 2], 16, 256)


@pytest.mark.parametrize("min_patches, max_patches", [(300, 256), (0, 256), (1, 0)])
def test_impossible_budget_raises_value_error(min_patches, max_patches):
    with pytest.raises(ValueError, match="min_patches"):
        native_grid(100, 100, 16, max_patches, min_patches)
    with pytest.raises(ValueError, match="min_patches") as caught:
        decode_native(encode(picture(20, 20, "noise")), 16, max_patches, min_patches=min_patches)
    assert not isinstance(caught.value, ImageError)
