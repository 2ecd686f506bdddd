"""Regions (boxes with a phrase): each box follows what the decoder did to the pixels (crop, squash,
native grids padded and packed, EXIF orientation, a JPEG decoded at reduced scale), boxes a crop
cuts away are dropped and counted, and manifests, shards and parquet files carry them alike.

A box is checked on the image itself: a red rectangle is painted where the box is, and the decoded
pixels inside the mapped box must be red and those just outside it must not."""

import io
import json
import math

import numpy as np
import pytest
import torch
from kits.datafiles import save, tiny_tokenizer, write_csv, write_jsonl
from PIL import Image

from vltrain.data.config import DataConfig
from vltrain.data.dataset import build_dataset
from vltrain.data.images import ORIENTATIONS
from vltrain.data.loading.collate import Collator
from vltrain.data.regions import RegionError, check_inside, parse_regions
from vltrain.errors import DataError

RED = (230, 20, 20)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def painted(width: int, height: int, box) -> Image.Image:
    """A blue-green gradient, and the box (pixel edges) filled red."""
    a = np.zeros((height, width, 3), np.uint8)
    a[..., 1] = np.linspace(40, 200, width, dtype=np.uint8)[None, :]
    a[..., 2] = np.linspace(200, 60, height, dtype=np.uint8)[:, None]
    x0, y0, x1, y1 = box
    a[y0:y1, x0:x1] = RED
    return Image.fromarray(a)


def region_rows(tmp_path, image: Image.Image, box, name="a.png", **save_kw) -> list[dict]:
    save(image, tmp_path / name, **save_kw)
    return [{"id": "r", "image": name, "text": "the red box", "regions": [{"box": list(box), "text": "the red box"}]}]


def dataset(tmp_path, tok, rows, **kw):
    data = DataConfig(train=str(write_jsonl(tmp_path / "m.jsonl", rows)), max_text_length=16, num_workers=0, **kw)
    return build_dataset(data, "train", tok), data


def picture(image: torch.Tensor, grid, patch: int) -> torch.Tensor:
    """[3, H, W] of a square image, or of a native one's patches [rows * cols, 3 * p * p]."""
    if grid is None:
        return image
    rows, cols = grid
    return image[: rows * cols].view(rows, cols, 3, patch, patch).permute(2, 0, 3, 1, 4).reshape(3, rows * patch,
                                                                                                   cols * patch)


def is_red(pixels: torch.Tensor) -> torch.Tensor:
    r, g, b = pixels.int()
    return (r > 170) & (g < 90) & (b < 90)


def assert_box_is_red(chw: torch.Tensor, box, margin: int = 2) -> None:
    """Inside the box, shrunk by ``margin`` pixels: all red; a line ``margin`` pixels outside each
    side (where the image has one): none red. Together: each mapped edge within about ``margin``
    pixels of the painted one."""
    _, h, w = chw.shape
    x0, y0, x1, y1 = box[0] * w, box[1] * h, box[2] * w, box[3] * h
    inner = chw[:, math.ceil(y0) + margin : math.floor(y1) - margin, math.ceil(x0) + margin : math.floor(x1) - margin]
    assert inner.numel() and is_red(inner).all(), f"not red inside the mapped box {box}"
    rows = slice(math.ceil(y0) + margin, math.floor(y1) - margin)
    cols = slice(math.ceil(x0) + margin, math.floor(x1) - margin)
    outside = {"left": (rows, math.floor(x0) - margin - 1), "right": (rows, math.ceil(x1) + margin),
               "top": (math.floor(y0) - margin - 1, cols), "bottom": (math.ceil(y1) + margin, cols)}
    for side, (r, c) in outside.items():
        if (isinstance(c, int) and 0 <= c < w) or (isinstance(r, int) and 0 <= r < h):
            assert not is_red(chw[:, r, c]).any(), f"red {side} of the mapped box {box}: it was mapped too small"


@pytest.mark.parametrize("resize", ["crop", "squash"])
def test_a_box_follows_the_square_crop_or_squash(tmp_path, tok, resize):
    box = (120, 30, 170, 90)  # inside the center crop of 200 x 120 (x 40 to 160 kept): cut by it on the right
    ds, _ = dataset(tmp_path, tok, region_rows(tmp_path, painted(200, 120, box), box), image_size=64, resize=resize)
    s = ds[0]
    want = [(120 - 40) / 120, 30 / 120, 1.0, 90 / 120] if resize == "crop" else [0.6, 0.25, 0.85, 0.75]
    np.testing.assert_allclose(s.regions.boxes[0], want, atol=1e-6)
    assert_box_is_red(s.image, s.regions.boxes[0])
    assert s.region_ids == [tok.encode("the red box", 16)[0]] and s.regions.cut == 0


@pytest.mark.parametrize("pack", [False, True])
def test_a_box_follows_the_native_grid_padded_and_packed(tmp_path, tok, pack):
    boxes = [(10, 70, 60, 110), (150, 10, 290, 40)]
    rows = []
    for k, box in enumerate(boxes):
        rows += region_rows(tmp_path, painted(300, 120, box), box, name=f"{k}.png")
        rows[-1]["id"] = f"r{k}"
    rows.append({"id": "t", "text": "no image"})
    ds, data = dataset(tmp_path, tok, rows, resize="native", max_patches=64, patch_size=8, pack_images=pack)
    samples = [ds[i] for i in range(len(ds))]
    batch = Collator.for_data(tok.pad_id, data)(samples)
    images = batch.images.unpacked()
    assert batch.images.layout == ("packed" if pack else "padded") and images.boxes.shape == (3, 1, 4)
    assert images.box_mask.tolist() == [[True], [True], [False]]
    for k, box in enumerate(boxes):
        rows_, cols = batch.images.grids[k].tolist()
        chw = picture(images.pixels[k], (rows_, cols), 8)
        np.testing.assert_allclose(images.boxes[k, 0].numpy(), [box[0] / 300, box[1] / 120, box[2] / 300, box[3] / 120],
                                   atol=1e-6)
        assert_box_is_red(chw, images.boxes[k, 0].tolist())


def stored_as(upright: Image.Image, turn: int) -> Image.Image:
    """The image to store with EXIF orientation ``turn`` so that it shows as ``upright``."""
    inverse = {Image.Transpose.ROTATE_90: Image.Transpose.ROTATE_270,
               Image.Transpose.ROTATE_270: Image.Transpose.ROTATE_90}
    op = ORIENTATIONS[turn][0]
    return upright.transpose(inverse.get(op, op))


@pytest.mark.parametrize("decoder", ["auto", "pillow"])
@pytest.mark.parametrize("turn", [3, 6, 8])
def test_a_box_given_on_the_shown_image_follows_an_exif_turned_jpeg(tmp_path, tok, turn, decoder):
    box = (20, 130, 70, 190)  # on the upright image, 100 wide x 220 high
    upright = painted(100, 220, box)
    exif = Image.Exif()
    exif[0x0112] = turn
    rows = region_rows(tmp_path, stored_as(upright, turn), box, name="a.jpg", quality=95, exif=exif.tobytes())
    ds, _ = dataset(tmp_path, tok, rows, image_size=64, jpeg_decoder=decoder)
    s = ds[0]
    np.testing.assert_allclose(s.regions.boxes[0], [0.2, (130 - 60) / 100, 0.7, 1.0], atol=1e-6)
    assert_box_is_red(s.image, s.regions.boxes[0])


@pytest.mark.parametrize("decoder", ["auto", "pillow"])
@pytest.mark.parametrize("resize", ["crop", "squash"])
def test_a_box_follows_a_jpeg_decoded_at_reduced_scale(tmp_path, tok, decoder, resize):
    """A 1603 x 1001 JPEG going to 48 px decodes at 1/8 scale, 201 x 126 pixels: a little more than
    an eighth of the image, which the mapping must know."""
    box = (820, 200, 1230, 700)
    rows = region_rows(tmp_path, painted(1603, 1001, box), box, name="a.jpg", quality=95)
    ds, _ = dataset(tmp_path, tok, rows, image_size=48, resize=resize, jpeg_decoder=decoder)
    s = ds[0]
    assert_box_is_red(s.image, s.regions.boxes[0], margin=1)
    if resize == "crop":  # decoded 201 x 126: the crop keeps x 37 to 163 of it, 296 to 1304 shown
        np.testing.assert_allclose(s.regions.boxes[0], [(820 - 296) / 1008, 200 / 1008, (1230 - 296) / 1008,
                                                        700 / 1008], atol=1e-6)


def test_regions_a_crop_cuts_away_are_dropped_and_counted_and_the_rest_clipped(tmp_path, tok):
    """300 x 100 cropped to its center, x 100 to 200: a box with less than half of its area inside
    is dropped, one with half or more is clipped to the crop; max_regions caps what is left."""
    rows = region_rows(tmp_path, painted(300, 100, (0, 0, 1, 1)), (0, 0, 1, 1))
    boxes = [(10, 10, 90, 90), (40, 10, 140, 50), (80, 10, 180, 50), (50, 60, 150, 90), (120, 20, 160, 80)]
    rows[0]["regions"] = [{"box": list(b), "text": f"box {k}"} for k, b in enumerate(boxes)]
    ds, data = dataset(tmp_path, tok, rows * 2, image_size=20)
    s = ds[0]
    assert (s.regions.cut, s.regions.capped) == (2, 0) and s.regions.texts == ["box 2", "box 3", "box 4"]
    np.testing.assert_allclose(s.regions.boxes, [[0, 0.1, 0.8, 0.5], [0, 0.6, 0.5, 0.9], [0.2, 0.2, 0.6, 0.8]],
                               atol=1e-6)
    capped, _ = dataset(tmp_path, tok, rows * 2, image_size=20, max_regions=2)
    assert (capped[0].regions.cut, capped[0].regions.capped, capped[0].regions.texts) == (2, 1, ["box 2", "box 3"])
    batch = Collator.for_data(tok.pad_id, data)([capped[0], capped[1]])
    assert (batch.num_regions_cut, batch.num_regions_capped) == (4, 2) and batch.images.boxes.shape == (2, 2, 4)
    off, _ = dataset(tmp_path, tok, rows, image_size=20, max_regions=0)
    assert off[0].regions is None and off[0].region_ids == []


def test_a_batch_mixes_rows_with_regions_without_them_text_only_and_image_only(tmp_path, tok):
    box = (10, 10, 40, 40)
    save(painted(50, 50, box), tmp_path / "a.png")
    regions = [{"box": [10, 10, 40, 40], "text": "red"}, {"box": [0, 0, 50, 25], "text": "the left and right"}]
    rows = [{"id": "two", "image": "a.png", "text": "red", "regions": regions},
            {"id": "none", "image": "a.png", "text": "red"},
            {"id": "text", "text": "red circle", "regions": regions},  # no image: no regions
            {"id": "image", "image": "a.png", "regions": regions[:1]}]
    ds, data = dataset(tmp_path, tok, rows, image_size=16)
    collate = Collator.for_data(tok.pad_id, data)
    batch = collate([ds[i] for i in range(4)])
    boxes = batch.images.boxes
    assert boxes.dtype == torch.float32 and boxes.shape == (4, 2, 4)
    assert batch.images.box_mask.tolist() == [[True, True], [False, False], [False, False], [True, False]]
    assert boxes[1:3].abs().sum() == 0 and boxes[3, 1].abs().sum() == 0
    np.testing.assert_allclose(boxes[0].numpy(), [[0.2, 0.2, 0.8, 0.8], [0, 0, 1, 0.5]], atol=1e-6)
    ids, mask = batch.region_ids, batch.region_attention_mask
    assert ids.dtype == torch.int64 and ids.shape[:2] == (4, 2) and ids.shape[2] % 8 == 0
    phrase = tok.encode("the left and right", 16)[0]
    assert ids[0, 1, : len(phrase)].tolist() == phrase and mask[0, 1].sum() == len(phrase)
    assert (ids[1:3] == tok.pad_id).all() and mask[1:3].sum() == 0 and mask[3, 1].sum() == 0
    inputs = batch.to_model_inputs("cpu", data.mean, data.std)
    assert inputs.images.boxes is batch.images.boxes or torch.equal(inputs.images.boxes, boxes)
    assert torch.equal(inputs.region_ids, ids) and torch.equal(inputs.region_attention_mask, mask)
    plain = collate([ds[1], ds[2]])  # no row keeps a region: the batch it always was
    assert plain.images.boxes is None and plain.region_ids is None and plain.images.box_mask is None
    assert set(plain.tensors()) == {"ids", "images.pixels", "has_image", "has_text", "input_ids", "attention_mask",
                                    "source"}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def test_regions_cross_from_a_loader_worker_in_the_shared_buffer(tmp_path, tok):
    box = (5, 5, 20, 20)
    rows = region_rows(tmp_path, painted(30, 30, box), box) + [{"id": "t", "text": "red"}]
    ds, data = dataset(tmp_path, tok, rows, image_size=8)
    collate = Collator.for_data(tok.pad_id, data)
    want = collate([ds[0], ds[1]])
    [got] = list(torch.utils.data.DataLoader(_Rows(ds), batch_size=2, num_workers=1, collate_fn=collate))
    for name in ("images.boxes", "images.box_mask", "region_ids", "region_attention_mask"):
        assert torch.equal(got.tensors()[name], want.tensors()[name]), name
    assert len({t.untyped_storage().data_ptr() for t in (got.ids, got.images.boxes, got.region_ids)}) == 1


# -- the row format, in every kind of source ------------------------------------------------------


REGIONS = [{"box": [2, 4, 30, 20], "text": "the top"}, {"box": [0, 22, 40, 30], "text": "the bottom strip"}]


def _expected(ds, tok) -> None:
    s = ds[0]
    np.testing.assert_allclose(s.regions.boxes, [[0.05, 4 / 30, 0.75, 20 / 30], [0, 22 / 30, 1, 1]], atol=1e-6)
    assert s.region_ids == [tok.encode(r["text"], 16)[0] for r in REGIONS]


def test_regions_in_a_jsonl_and_a_csv_manifest(tmp_path, tok):
    save(painted(40, 30, (0, 0, 1, 1)), tmp_path / "a.png")
    ds, _ = dataset(tmp_path, tok, [{"image": "a.png", "text": "x", "regions": REGIONS}], image_size=16,
                    resize="squash")
    _expected(ds, tok)
    path = write_csv(tmp_path / "m.csv", ["filepath", "title", "regions"], [["a.png", "x", json.dumps(REGIONS)]])
    csv_ds = build_dataset(DataConfig(train=str(path), image_size=16, resize="squash", max_text_length=16), "train",
                           tok)
    _expected(csv_ds, tok)


def test_regions_in_a_webdataset_shards_json(tmp_path, tok):
    import webdataset as wds

    buf = io.BytesIO()
    painted(40, 30, (0, 0, 1, 1)).save(buf, "PNG")
    with wds.TarWriter(str(tmp_path / "00000.tar")) as sink:
        sink.write({"__key__": "k0", "png": buf.getvalue(), "txt": "x", "json": {"regions": REGIONS, "width": 40}})
        sink.write({"__key__": "k1", "png": buf.getvalue(), "txt": "y", "json": {"width": 40}})
    ds = build_dataset(DataConfig(train=str(tmp_path / "{00000..00000}.tar"), image_size=16, resize="squash",
                                  max_text_length=16), "train", tok)
    _expected(ds, tok)
    assert ds[1].regions is None


@pytest.mark.parametrize("stored", ["structs", "json"])
def test_regions_in_a_parquet_column(tmp_path, tok, stored):
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    painted(40, 30, (0, 0, 1, 1)).save(buf, "PNG")
    region = pa.struct([("box", pa.list_(pa.float64())), ("text", pa.string())])
    column = pa.array([REGIONS, None], pa.list_(region)) if stored == "structs" else \
        pa.array([json.dumps(REGIONS), None], pa.string())
    table = pa.table({"image": pa.array([{"bytes": buf.getvalue(), "path": "a.png"}] * 2),
                      "text": ["x", "y"], "regions": column})
    pq.write_table(table, tmp_path / "train.parquet")
    ds = build_dataset(DataConfig(train=str(tmp_path / "train.parquet"), image_size=16, resize="squash",
                                  max_text_length=16), "train", tok)
    _expected(ds, tok)
    assert ds[1].regions is None


# -- bad regions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("regions, says", [
    ("not a list", "not JSON"),
    ({"box": [0, 0, 1, 1]}, "must be a list"),
    ([[0, 0, 1, 1]], "regions[0]: must be an object"),
    ([{"box": [0, 0, 1], "text": "a"}], "regions[0]: box must be 4 numbers"),
    ([{"box": [0, "0", 1, 1], "text": "a"}], "box must be 4 numbers"),
    ([{"box": [0, 0, True, 1], "text": "a"}], "box must be 4 numbers"),
    ([{"box": [0, 0, 1, 1], "text": "a"}, {"box": [5, 0, 2, 1], "text": "b"}], "regions[1]: box [5, 0, 2, 1] is empty"),
    ([{"box": [0, 3, 1, 3], "text": "a"}], "empty or inverted"),
    ([{"box": [0, 0, 1, 1], "text": " "}], 'text must be a phrase, got " "'),
    ([{"box": [0, 0, 1, 1]}], "text must be a phrase, got null"),
])
def test_a_malformed_region_is_named(regions, says):
    with pytest.raises(RegionError) as e:
        parse_regions(regions)
    assert says in str(e.value)


def test_a_box_outside_the_image_as_shown_is_named():
    regions = parse_regions([{"box": [0, 0, 10, 10], "text": "a"}, {"box": [5, 5, 41, 10], "text": "b"}])
    check_inside(regions[:1], 40, 30)
    with pytest.raises(RegionError, match=r"regions\[1\]: box \[5, 5, 41, 10\] is not inside the 40x30 image"):
        check_inside(regions, 40, 30)


def test_a_row_with_a_bad_region_is_a_bad_sample(tmp_path, tok):
    box = (5, 5, 20, 20)
    rows = region_rows(tmp_path, painted(30, 30, box), box) + region_rows(tmp_path, painted(30, 30, box), box)
    rows[0]["id"], rows[0]["regions"][0]["box"] = "bad", [5, 5, 31, 20]
    ds, _ = dataset(tmp_path, tok, rows, image_size=8)
    s = ds[0]
    assert s.key == "r" and len(s.errors) == 1
    key, reason = s.errors[0]
    assert key == "bad" and "regions[0]: box [5, 5, 31, 20] is not inside the 30x30 image" in reason
    assert "vltrain data validate" in reason
    strict, _ = dataset(tmp_path, tok, rows, image_size=8, on_error="fail")
    with pytest.raises(DataError, match=r"(?s)bad sample 'bad' \(m.jsonl:1\): regions\[0\].*data.on_error: skip"):
        strict[0]
