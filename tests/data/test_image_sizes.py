"""Image sizes read from headers, and the patch counts a patch budget plans with: equal to what
img2dataset recorded, to each sample's own grid once decoded, with EXIF turns and bad images."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from kits.datafiles import tiny_tokenizer, write_jsonl
from PIL import Image

from vltrain.data.config import DataConfig
from vltrain.data.dataset import build_dataset
from vltrain.data.index import sizes
from vltrain.data.index.open import open_indexed
from vltrain.data.index.sizes import SIZES_FILE, header_size, image_sizes
from vltrain.data.native import decode_native, native_grid, patch_counts

KEEP_RATIO = Path(__file__).parent / "fixtures" / "img2dataset-keep-ratio"
"""Shards img2dataset wrote with resize_mode keep_ratio (fixtures/make_img2dataset.py)."""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def shards(tmp_path: Path) -> str:
    """A copy of the img2dataset shards (their index is written beside them)."""
    for f in KEEP_RATIO.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    return f"{tmp_path}/{{00000..00001}}.tar"


def test_sizes_of_img2dataset_shards_are_those_it_recorded(tmp_path):
    spec = shards(tmp_path)
    source = open_indexed(spec, None, 16)
    got = image_sizes(source)
    recorded = {}
    for part in ("00000", "00001"):
        for row in pq.read_table(tmp_path / f"{part}.parquet").to_pylist():
            if row["status"] == "success":
                recorded[row["key"]] = (row["height"], row["width"])
    keys = [source.row(i).key for i in range(len(source))]
    assert len(keys) == len(recorded) == 40
    assert {k: tuple(int(x) for x in got[i]) for i, k in enumerate(keys)} == recorded
    assert len({tuple(r) for r in recorded.values()}) >= 5  # wide, tall and square ones
    stored = source.index_dir / SIZES_FILE
    made = stored.stat().st_mtime_ns
    assert np.array_equal(image_sizes(open_indexed(spec, None, 16)), got) and stored.stat().st_mtime_ns == made


def test_sizes_read_in_parallel_parts_equal_those_read_in_one(tmp_path, monkeypatch):
    spec = shards(tmp_path)
    alone = np.array(sizes.read_sizes(open_indexed(spec, None, 16), 0, 40))
    monkeypatch.setattr(sizes, "PART_ROWS", 7)
    monkeypatch.setattr(sizes, "MIN_PARALLEL_ROWS", 1)
    assert np.array_equal(image_sizes(open_indexed(spec, None, 16), workers=2), alone)
    assert not list(open_indexed(spec, None, 16).index_dir.glob("*.parts"))  # the parts are gone once merged


def jpeg_turned(width: int, height: int, orientation: int) -> bytes:
    """A width x height JPEG stored with an EXIF orientation."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    Image.new("RGB", (width, height), (30, 140, 200)).save(out, "JPEG", exif=exif)
    return out.getvalue()


def test_a_header_gives_the_size_as_shown():
    assert header_size(jpeg_turned(60, 20, 1)) == (20, 60)
    assert header_size(jpeg_turned(60, 20, 6)) == (60, 20)  # turned a quarter: shown tall
    assert header_size(jpeg_turned(60, 20, 3)) == (20, 60)  # upside down: the same sides
    assert header_size(b"not an image") == (0, 0)
    assert header_size(b"") == (0, 0)


@pytest.mark.parametrize("turn", range(1, 9))
def test_an_exif_turned_jpegs_planned_grid_is_its_decoded_grid(turn):
    """The index plans from the header (``header_size`` -> ``patch_counts``) and the loader decodes
    (``decode_native``); both read the orientation through ``images.orientation``, so a photo stored
    96 wide and 24 high, turned a quarter (5-8, e.g. 6, a phone held upright), is planned and
    decoded tall."""
    data = jpeg_turned(96, 24, turn)
    size = header_size(data)
    assert size == ((96, 24) if turn >= 5 else (24, 96))
    planned = patch_counts(np.array([size]), np.array([True]), 8, 24)
    patches, grid = decode_native(data, 8, 24)
    assert grid == native_grid(*size, 8, 24) and (grid[0] > grid[1]) == (turn >= 5)
    assert planned.tolist() == [grid[0] * grid[1]] == [len(patches)]


def test_planned_patches_are_the_grids_the_samples_get(tmp_path, tok):
    """For every row, the table's patch count is what loading the sample gives: wide, tall, tiny,
    EXIF-turned; 0 without an image; the whole budget for an image that cannot be read (it is
    replaced when loaded, by one planned to fit)."""
    (tmp_path / "img").mkdir()
    rows = []
    for k, (w, h) in enumerate([(300, 40), (40, 300), (12, 12), (90, 90), (1000, 3), (64, 48)]):
        Image.new("RGB", (w, h), (10 * k, 200, 50)).save(tmp_path / "img" / f"{k}.png")
        rows.append({"id": f"p{k}", "image": f"img/{k}.png", "text": "a shape"})
    (tmp_path / "img" / "turned.jpg").write_bytes(jpeg_turned(120, 30, 8))
    (tmp_path / "img" / "bad.jpg").write_bytes(b"\xff\xd8 cut short")
    rows += [{"id": "turned", "image": "img/turned.jpg", "text": "turned"}, {"id": "text", "text": "no image"},
             {"id": "bad", "image": "img/bad.jpg", "text": "broken"}]
    m = write_jsonl(tmp_path / "m.jsonl", rows)
    for upscale, min_patches in ((True, 1), (False, 1), (False, 6)):
        c = DataConfig(train=str(m), tokenizer=str(tok.path), resize="native", max_patches=24, min_patches=min_patches,
                       patch_size=8, upscale=upscale, on_error="skip", batching="budget", patch_budget=48)
        ds = build_dataset(c, "train", tok, plan_aware=True)
        planned = ds.table().patches
        for i in range(len(rows) - 1):
            sample = ds[i]
            assert planned[i] == (int(np.prod(sample.grid)) if sample.image is not None else 0), rows[i]["id"]
        assert planned[len(rows) - 1] == 24  # unreadable: counted at the whole budget
        replacement = ds[len(rows) - 1]
        assert replacement.errors and int(np.prod(replacement.grid)) <= 24
    assert planned[6] == int(np.prod(ds[6].grid)) and ds[6].grid[0] > ds[6].grid[1]  # shown tall
