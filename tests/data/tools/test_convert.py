"""``vltrain data shard``: images resized as they are written, and tar shards to Hub-style parquet
and back with the same samples."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from PIL import Image

from vltrain.data.tools.convert import resizer

FIXTURES = Path(__file__).parent.parent / "fixtures" / "img2dataset"


def _image(size: tuple[int, int], mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    im = Image.linear_gradient("L").resize(size).convert(mode)
    out = io.BytesIO()
    im.save(out, fmt)
    return out.getvalue()


def test_resizing_keeps_the_aspect_ratio_and_never_enlarges():
    resize = resizer(256, quality=90)
    data, ext = resize(_image((500, 375)), "photo.jpg")
    assert ext == "jpg" and Image.open(io.BytesIO(data)).size == (341, 256)
    data, ext = resize(_image((300, 900), fmt="PNG"), "tall.png")
    assert ext == "jpg" and Image.open(io.BytesIO(data)).size == (256, 768)
    small = _image((200, 120))
    assert resize(small, "small.jpg") == (small, "jpg")  # shorter side below 256: unchanged
    data, ext = resize(_image((600, 400), "RGBA", "PNG"), "logo.png")
    assert ext == "png" and Image.open(io.BytesIO(data)).size == (384, 256)  # transparency kept


def test_quality_sets_the_jpeg_size():
    photo = Image.effect_noise((500, 375), 40).convert("RGB")
    raw = io.BytesIO()
    photo.save(raw, "PNG")
    low, _ = resizer(256, 50)(raw.getvalue(), "x.png")
    high, _ = resizer(256, 95)(raw.getvalue(), "x.png")
    assert len(low) < len(high)


def test_bad_settings_and_bad_images_are_named():
    from vltrain.errors import UserError

    with pytest.raises(UserError, match="--quality"):
        resizer(256, 0)
    with pytest.raises(ValueError, match="cannot be resized"):
        resizer(256)(b"not an image", "x.jpg")


def _samples(source) -> list[tuple[str, str | None, bytes | None]]:
    return [(source.row(i).key, source.row(i).text, source.read_image(i) if source.row(i).image else None)
            for i in range(len(source))]


def test_tar_to_parquet_and_back_keeps_every_sample(tmp_path):
    from vltrain.data.index.open import open_indexed
    from vltrain.data.sources.shards import ShardSource, write_shards
    from vltrain.data.tools.convert import write_parquet

    for name in ("00000", "00002"):
        shutil.copy(FIXTURES / f"{name}.tar", tmp_path / f"{name}.tar")
    tars = ShardSource(str(tmp_path / "{00000,00002}.tar"))
    files, skipped = write_parquet(tars, tmp_path / "pq", rows_per_file=15, row_group=4)
    assert skipped == [] and [f.name for f in files] == ["train-00000-of-00003.parquet",
                                                         "train-00001-of-00003.parquet", "train-00002-of-00003.parquet"]
    parquet = open_indexed(str(tmp_path / "pq" / "train-*.parquet"), None, 77)
    assert _samples(parquet) == _samples(tars)  # ids, captions and image bytes
    back, skipped = write_shards(parquet, tmp_path / "back", 1000)
    assert skipped == [] and _samples(ShardSource(str(back[0]))) == _samples(tars)


def test_the_parquet_files_read_as_a_hub_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    from vltrain.data.sources.shards import ShardSource
    from vltrain.data.tools.convert import write_parquet

    shutil.copy(FIXTURES / "00000.tar", tmp_path / "00000.tar")
    write_parquet(ShardSource(str(tmp_path / "00000.tar")), tmp_path / "pq", rows_per_file=100)
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "pq" / "*.parquet"), split="train",
                               cache_dir=str(tmp_path / "hf"))
    assert isinstance(ds.features["image"], datasets.Image) and len(ds) == 19
    assert ds[0]["image"].size == (256, 256) and ds[0]["text"]


def test_shard_cli_resizes_and_converts(tmp_path, capsys):
    from kits.datafiles import run_cli

    shutil.copy(FIXTURES / "00000.tar", tmp_path / "00000.tar")
    code, out, _ = run_cli(capsys, "data", "shard", tmp_path / "00000.tar", "--out", tmp_path / "small",
                           "--image-size", "64", "--quality", "80")
    assert code == 0 and "wrote 19 samples in 1 shard(s)" in out
    from vltrain.data.sources.shards import ShardSource

    small = ShardSource(str(tmp_path / "small" / "00000.tar"))
    assert {Image.open(io.BytesIO(small.read_image(i))).size for i in range(len(small))} == {(64, 64)}
    code, out, _ = run_cli(capsys, "data", "shard", tmp_path / "small" / "00000.tar", "--out", tmp_path / "pq",
                           "--format", "parquet")
    assert code == 0 and "wrote 19 samples in 1 file(s)" in out and (tmp_path / "pq" / "train-00000-of-00001.parquet").is_file()


def test_regions_travel_through_shards_and_parquet_and_follow_a_resize(tmp_path, capsys, monkeypatch):
    """A manifest's regions reach tar shards and parquet and come back; with --image-size the boxes
    scale with their (EXIF-turned) image, so the dataset maps each to the same place, to within a
    sixth of a pixel of the 16 px image: a JPEG decoded at reduced scale rounds its size up (304 px
    of a 300 px side at 1/8, 61.3 of 60 at 3/8), and the boxes follow those pixels exactly."""
    import json

    import numpy as np
    from kits.datafiles import run_cli, tiny_tokenizer, write_jsonl

    from vltrain.data.config import DataConfig
    from vltrain.data.dataset import build_dataset

    monkeypatch.chdir(tmp_path)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 400 x 300, shown 300 x 400
    Image.new("RGB", (400, 300), (90, 90, 90)).save(tmp_path / "a.jpg", exif=exif.tobytes())
    regions = [{"box": [30, 40, 150, 240], "text": "the left"}, {"box": [0, 300, 300, 400], "text": "the bottom"}]
    write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "image": "a.jpg", "text": "x", "regions": regions},
                                       {"id": "t", "text": "text only"}])
    steps = [("data", "shard", "m.jsonl", "--out", "small", "--image-size", "60"),
             ("data", "shard", "small/00000.tar", "--out", "pq", "--format", "parquet"),
             ("data", "shard", "pq/train-00000-of-00001.parquet", "--out", "back")]
    for argv in steps:
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, out + err
    member = json.loads(next(v for k, v in _members(tmp_path / "back" / "00000.tar").items() if k.endswith(".json")
                             and b"regions" in v))
    assert member["regions"] == [{"box": [6, 8, 30, 48], "text": "the left"}, {"box": [0, 60, 60, 80],
                                                                               "text": "the bottom"}]
    tok = tiny_tokenizer(tmp_path)
    boxes = []
    for source in ("m.jsonl", "small/00000.tar", "pq/train-00000-of-00001.parquet", "back/00000.tar"):
        ds = build_dataset(DataConfig(train=source, image_size=16, max_text_length=16, resize="squash"), "train", tok)
        boxes.append(ds[0].regions.boxes)
        assert ds[1].regions is None
    np.testing.assert_allclose(boxes[0], [[30 / 304, 0.1, 150 / 304, 0.6], [0, 0.75, 300 / 304, 1]], atol=1e-6)
    for other in boxes[1:]:
        np.testing.assert_allclose(other, boxes[0], atol=0.01)


def _members(path: Path) -> dict[str, bytes]:
    import tarfile

    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
