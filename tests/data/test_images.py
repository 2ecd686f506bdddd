import functools
import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from vltrain.data import images
from vltrain.data.images import ImageError, decode_image, load_rgb, resize_pixels


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def test_output_is_uint8_chw_of_the_configured_size():
    out = decode_image(encode(Image.new("RGB", (40, 30), (10, 20, 30))), 16)
    assert out.dtype == torch.uint8 and out.shape == (3, 16, 16) and out.is_contiguous()
    assert out[:, 8, 8].tolist() == [10, 20, 30]


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: Image.new("L", (8, 8), 77), [77, 77, 77]),
        (lambda: Image.new("LA", (8, 8), (0, 0)), [255, 255, 255]),  # transparent -> white
        (lambda: Image.new("LA", (8, 8), (40, 255)), [40, 40, 40]),
        (lambda: Image.new("RGBA", (8, 8), (200, 10, 10, 0)), [255, 255, 255]),
        (lambda: Image.new("RGBA", (8, 8), (200, 10, 10, 255)), [200, 10, 10]),
        (lambda: Image.new("CMYK", (8, 8), (0, 255, 255, 0)), [255, 0, 0]),
        (lambda: Image.fromarray(np.full((8, 8), 0x8000, dtype=np.uint16)), [128, 128, 128]),
    ],
    ids=["L", "LA-transparent", "LA-opaque", "RGBA-transparent", "RGBA-opaque", "CMYK", "I;16"],
)
def test_every_mode_becomes_rgb(make, expected):
    im = make()
    fmt = "TIFF" if im.mode == "CMYK" else "PNG"
    out = decode_image(encode(im, fmt), 8)
    assert out.shape == (3, 8, 8)
    assert out[:, 4, 4].tolist() == expected


def test_sixteen_bit_grey_keeps_its_range():
    a = np.tile(np.array([0, 0x4000, 0xFFFF], dtype=np.uint16), (3, 1))
    im = Image.fromarray(a)
    assert im.mode == "I;16"
    out = decode_image(encode(im), 3, resize="squash")
    assert out[0, 0].tolist() == [0, 64, 255]


def test_palette_with_transparency_composites_on_white():
    im = Image.new("P", (8, 8), 1)
    im.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    im.info["transparency"] = 1
    data = encode(im, transparency=1)
    assert decode_image(data, 8)[:, 0, 0].tolist() == [255, 255, 255]
    im2 = Image.new("P", (8, 8), 1)
    im2.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    assert decode_image(encode(im2), 8)[:, 0, 0].tolist() == [10, 200, 30]


def test_exif_orientation_is_applied():
    # A 20x10 image, left half red, right half blue, tagged "rotate 90 CW" (orientation 6):
    # displayed it is 10x20, red on top.
    im = Image.new("RGB", (20, 10), (0, 0, 255))
    im.paste((255, 0, 0), (0, 0, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(im, "JPEG", quality=95, exif=exif.tobytes())
    out = decode_image(data, 10, resize="squash")
    top, bottom = out[:, 1, 5].tolist(), out[:, 8, 5].tolist()
    assert top[0] > 200 and top[2] < 60
    assert bottom[2] > 200 and bottom[0] < 60


@pytest.mark.parametrize("turn", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_one_orientation_rule_for_pillow_arrays_and_sizes(turn):
    """``upright``, ``upright_pixels`` and ``shown_size`` agree with ImageOps.exif_transpose (what
    the three decoders and the size reader each did before) for every orientation, and an
    orientation outside 2-8 leaves the image as it is."""
    rng = np.random.default_rng(turn)
    im = Image.fromarray(rng.integers(0, 256, (6, 10, 3), dtype=np.uint8))  # 10 wide, 6 high
    exif = Image.Exif()
    exif[0x0112] = turn
    opened = Image.open(io.BytesIO(encode(im, "PNG", exif=exif.tobytes())))
    want = np.asarray(ImageOps.exif_transpose(opened))
    assert images.orientation(opened) == (turn if 2 <= turn <= 8 else 1)
    assert images.shown_size(opened) == want.shape[:2]
    assert np.array_equal(np.asarray(images.upright(opened)), want)
    stored = torch.from_numpy(np.array(opened.convert("RGB")))
    assert np.array_equal(images.upright_pixels(stored, images.orientation(opened)).numpy(), want)


def test_crop_keeps_the_center_and_squash_keeps_everything():
    # 30x10: red | green | blue thirds.
    im = Image.new("RGB", (30, 10), (255, 0, 0))
    im.paste((0, 255, 0), (10, 0, 20, 10))
    im.paste((0, 0, 255), (20, 0, 30, 10))
    data = encode(im)
    crop = decode_image(data, 10, resize="crop")
    assert crop[:, 5, 1].tolist() == [0, 255, 0] and crop[:, 5, 8].tolist() == [0, 255, 0]
    squash = decode_image(data, 9, resize="squash")
    assert squash[:, 4, 0].tolist() == [255, 0, 0]
    assert squash[:, 4, 4].tolist() == [0, 255, 0]
    assert squash[:, 4, 8].tolist() == [0, 0, 255]


def test_big_jpeg_is_decoded_at_reduced_scale():
    data = encode(Image.new("RGB", (2000, 1600), (90, 140, 200)), "JPEG", quality=90)
    assert load_rgb(data, 64).size == (250, 200)  # libjpeg's 1/8 scale, not 2000x1600
    assert load_rgb(data, 64, "squash").size == (250, 200)
    assert load_rgb(data, 300).size == (500, 400)  # 1/4: the shorter side stays >= 300
    assert load_rgb(data, 900).size == (2000, 1600)
    assert load_rgb(data, 900, draft_ratio=0.8).size == (1000, 800)  # 800 >= 0.8 * 900: upsampled
    out = decode_image(data, 64)
    assert out.shape == (3, 64, 64)
    assert abs(out[0, 32, 32].item() - 90) <= 3


def test_resize_matches_pillow_bicubic():
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (60, 90, 3), dtype=np.uint8)).resize((300, 200))
    ours = decode_image(encode(im), 48)
    pillow = im.crop((50, 0, 250, 200)).resize((48, 48), Image.Resampling.BICUBIC)
    diff = (ours.permute(1, 2, 0).int() - torch.from_numpy(np.array(pillow)).int()).abs()
    assert diff.max() <= 3 and diff.float().mean() < 0.5


def test_small_images_are_upscaled():
    assert decode_image(encode(Image.new("RGB", (4, 6), (1, 2, 3))), 32).shape == (3, 32, 32)


def test_resize_is_a_copy_at_the_right_size():
    hwc = torch.randint(0, 255, (16, 16, 3), dtype=torch.uint8)
    assert torch.equal(resize_pixels(hwc, 16), hwc.permute(2, 0, 1))


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "empty file"),
        (b"this is a text file, not a png" * 10, "not an image"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "not an image"),
    ],
    ids=["zero-byte", "text-with-image-extension", "corrupt-header"],
)
def test_unreadable_bytes_raise_image_error_with_reason(data, reason):
    with pytest.raises(ImageError, match=reason):
        decode_image(data, 16)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_file_raises_image_error(fmt):
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    data = encode(im, fmt)
    with pytest.raises(ImageError, match="cannot decode"):
        decode_image(data[: len(data) // 2], 16)


def test_decompression_bomb_is_refused_from_the_header():
    # A 4000x4000 PNG of one colour is a few KB on disk: the pixel count is what matters.
    data = encode(Image.new("L", (4000, 4000), 0))
    assert len(data) < 100_000
    with pytest.raises(ImageError, match="decompression bomb"):
        decode_image(data, 16, max_pixels=1_000_000)
    assert decode_image(data, 16, max_pixels=16_000_000).shape == (3, 16, 16)


# -- the simplejpeg path for JPEGs -----------------------------------------------------------------

needs_simplejpeg = pytest.mark.skipif(images.simplejpeg is None, reason="simplejpeg not installed")


@functools.lru_cache(maxsize=None)
def photo_jpeg(w: int, h: int, seed: int = 0, **save) -> bytes:
    """Smooth colour fields plus sensor-like noise, saved as JPEG quality 90: compresses like a photo."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    a = np.stack([128 + 90 * np.sin(f * x + p) * np.cos(g * y + p) for f, g, p in rng.uniform(1, 8, (3, 3))], -1)
    a = a + rng.normal(0, 8, a.shape)
    return encode(Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)), "JPEG", quality=90, **save)


def mean_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().mean().item()


@needs_simplejpeg
@pytest.mark.parametrize(
    "wh, scaled, close",
    [
        ((500, 375), (235, 313), 2.5),  # 5/8: measured 2.26 grey levels (crop), 1.40 (squash)
        ((375, 500), (313, 235), 2.5),
        ((800, 600), (225, 300), 2.0),  # 3/8: 1.41, 0.70
        ((1000, 750), (282, 375), 1.5),  # 3/8: 1.00, 0.80
        ((640, 480), (240, 320), 0.0),  # 4/8, Pillow's draft scale: the same pixels
        ((2000, 1500), (375, 500), 0.0),  # 2/8
        ((300, 200), (200, 300), 0.0),  # smaller than needed: full size
    ],
)
@pytest.mark.parametrize("resize", ["crop", "squash"])
def test_fast_jpeg_path_is_close_to_the_pillow_path(wh, scaled, close, resize):
    data = photo_jpeg(*wh)
    hwc = images.load_jpeg(data, 224, resize)
    assert tuple(hwc.shape) == (*scaled, 3)  # the smallest of 1/8 .. 5/8, 8/8 still >= 224
    fast = decode_image(data, 224, resize)
    slow = decode_image(data, 224, resize, jpeg_decoder="pillow")
    assert fast.shape == slow.shape == (3, 224, 224)
    assert mean_abs_diff(fast, slow) <= close


@needs_simplejpeg
@pytest.mark.parametrize("size, scaled", [(150, (188, 250)), (120, (141, 188)), (60, (94, 125)), (20, (47, 63))])
def test_fast_jpeg_path_never_upsamples(size, scaled):
    data = photo_jpeg(500, 375)
    hwc = images.load_jpeg(data, size, "crop")
    assert tuple(hwc.shape) == (*scaled, 3)
    assert min(hwc.shape[:2]) >= size


@needs_simplejpeg
@pytest.mark.parametrize("orientation", range(1, 9))
def test_fast_jpeg_path_applies_every_exif_orientation(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = photo_jpeg(48, 32, seed=orientation, exif=exif.tobytes())
    upright = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data)).convert("RGB")))
    fast = images.load_jpeg(data, 64, "squash")  # no reduced scale
    assert fast is not None and fast.numpy().tolist() == upright.tolist()
    assert torch.equal(decode_image(data, 16, "squash"), decode_image(data, 16, "squash", jpeg_decoder="pillow"))


@needs_simplejpeg
def test_fast_jpeg_path_applies_xmp_orientation():
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
           b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    data = photo_jpeg(48, 32, xmp=xmp)
    assert tuple(images.load_jpeg(data, 64, "squash").shape) == (48, 32, 3)
    assert torch.equal(decode_image(data, 16, "squash"), decode_image(data, 16, "squash", jpeg_decoder="pillow"))


@needs_simplejpeg
def test_fast_jpeg_path_turns_grey_into_rgb():
    grey = Image.open(io.BytesIO(photo_jpeg(40, 30))).convert("L")
    data = encode(grey, "JPEG", quality=90)
    assert tuple(images.load_jpeg(data, 64).shape) == (30, 40, 3)
    assert torch.equal(decode_image(data, 24), decode_image(data, 24, jpeg_decoder="pillow"))


@needs_simplejpeg
def test_cmyk_jpeg_falls_back_to_pillow():
    data = encode(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95)
    assert images.load_jpeg(data, 16, "crop") is None
    r, g, b = decode_image(data, 16)[:, 8, 8].tolist()
    assert r > 200 and g < 60 and b < 60


def test_jpegs_decode_without_simplejpeg(monkeypatch):
    data = photo_jpeg(40, 30)
    expected = decode_image(data, 16, jpeg_decoder="pillow")
    monkeypatch.setattr(images, "simplejpeg", None)
    assert torch.equal(decode_image(data, 16), expected)


def test_jpeg_bomb_is_refused_before_any_decoder_runs():
    data = photo_jpeg(1200, 1000)
    with pytest.raises(ImageError, match="decompression bomb"):
        decode_image(data, 16, max_pixels=1_000_000)
    with pytest.raises(ImageError, match="decompression bomb"):
        decode_image(data, 16, max_pixels=1_000_000, jpeg_decoder="pillow")
