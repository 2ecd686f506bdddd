import time

import numpy as np
import pytest
import torch
from kits.datafiles import caption, distinct_image, save, tiny_tokenizer, write_csv, write_jsonl

from vltrain.data.config import DataConfig, SourceSpec
from vltrain.data.dataset import MAX_TRIES, build_dataset
from vltrain.data.ids import stable_uid
from vltrain.data.images import decode_image
from vltrain.data.loading.collate import Collator
from vltrain.data.sources.manifests import ManifestSource
from vltrain.data.sources.shards import write_shards
from vltrain.errors import DataError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def good_rows(tmp_path, n, start=0):
    rows = []
    for i in range(start, start + n):
        save(distinct_image(i), tmp_path / "img" / f"{i}.png")
        rows.append({"id": f"r{i}", "image": f"img/{i}.png", "text": caption(i)})
    return rows


def cfg(train, **kw) -> DataConfig:
    return DataConfig(train=train, image_size=8, max_text_length=16, **kw)


def test_sample_holds_decoded_image_tokens_and_id(tmp_path, tok):
    rows = good_rows(tmp_path, 3) + [{"id": "t", "text": "red circle"}, {"id": "i", "image": "img/0.png"}]
    ds = build_dataset(cfg(str(write_jsonl(tmp_path / "m.jsonl", rows))), "train", tok)
    assert len(ds) == 5 and ds.source_names == [str(tmp_path / "m.jsonl")]
    s = ds[1]
    assert (s.key, s.uid, s.source, s.errors) == ("r1", stable_uid("r1"), 0, [])
    assert s.image.dtype == torch.uint8
    assert torch.equal(s.image, decode_image((tmp_path / "img" / "1.png").read_bytes(), 8))
    assert s.input_ids == tok.encode(caption(1), 16)[0]
    assert ds[3].image is None and ds[3].input_ids
    assert ds[4].image is not None and ds[4].input_ids == []


def test_table_matches_samples(tmp_path, tok):
    rows = good_rows(tmp_path, 2) + [{"text": "red " * 40}, {"image": "img/0.png"}]
    ds = build_dataset(cfg(str(write_jsonl(tmp_path / "m.jsonl", rows))), "train", tok)
    t = ds.table()
    assert t is ds.table()
    assert t.has_image.tolist() == [True, True, False, True]
    assert t.has_text.tolist() == [True, True, True, False]
    assert t.text_len.tolist() == [len(ds[i].input_ids) for i in range(4)]
    assert t.text_len[2] == 16 and ds[2].truncated
    assert t.source.dtype == np.int16 and t.text_len.dtype == np.uint16  # the sample index column


def test_mixture_of_manifest_csv_and_shards(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", good_rows(tmp_path, 3))
    b = write_csv(tmp_path / "b.csv", ["filepath", "title"], [[f"img/{i}.png", caption(i)] for i in range(3, 5)])
    write_shards(ManifestSource(a), tmp_path / "sh", 2)
    c = DataConfig(
        train=[SourceSpec(str(a), 2.0), SourceSpec(str(b)), SourceSpec(str(tmp_path / "sh/{00000..00001}.tar"))],
        image_size=8, max_text_length=16,
    )
    ds = build_dataset(c, "train", tok)
    assert len(ds) == 8 and ds.source_weights == [2.0, 1.0, 1.0]
    assert ds.table().source.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert [ds[i].key for i in (0, 5)] == ["r0", "r0"]
    assert torch.equal(ds[5].image, ds[0].image)


def test_empty_split_and_unknown_split(tmp_path, tok):
    with pytest.raises(DataError, match="data.val is empty"):
        build_dataset(cfg("x.jsonl"), "val", tok)
    with pytest.raises(ValueError):
        build_dataset(cfg("x.jsonl"), "test", tok)


def bad_files(tmp_path) -> dict[str, str]:
    """Each kind of unreadable image, as a file path relative to tmp_path."""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "zero.png").write_bytes(b"")
    (tmp_path / "bad" / "text.jpg").write_text("I am not a JPEG")
    good = (tmp_path / save(distinct_image(99, (64, 64)), tmp_path / "bad" / "full.jpg")).read_bytes()
    (tmp_path / "bad" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    save(distinct_image(98, (3000, 3000)), tmp_path / "bad" / "bomb.png")
    return {
        "zero": "bad/zero.png",
        "text": "bad/text.jpg",
        "truncated": "bad/truncated.jpg",
        "missing": "bad/missing.png",
        "bomb": "bad/bomb.png",
    }


REASONS = {
    "zero": "empty file",
    "text": "not an image",
    "truncated": "cannot decode image",
    "missing": "image file not found: bad/missing.png",
    "bomb": "decompression bomb",
}


def test_each_bad_sample_is_replaced_deterministically_and_reported(tmp_path, tok):
    bad = bad_files(tmp_path)
    rows = good_rows(tmp_path, 6) + [{"id": name, "image": path, "text": "red"} for name, path in bad.items()]
    m = str(write_jsonl(tmp_path / "m.jsonl", rows))
    ds = build_dataset(cfg(m, max_image_pixels=1_000_000), "train", tok)
    for i, name in enumerate(bad, start=6):
        s = ds[i]
        assert s.key.startswith("r"), name  # a good sample took its place
        assert s.errors[0][0] == name  # (a replacement may be bad too: then it is listed as well)
        assert all(REASONS[k] in reason for k, reason in s.errors)
        assert all(bad[k] in reason for k, reason in s.errors)  # the image's path, for bad_samples.jsonl
        again = ds[i]
        assert (again.key, again.errors) == (s.key, s.errors)
    # The replacement is a whole, aligned sample.
    s = ds[6]
    j = int(s.key[1:])
    assert s.input_ids == tok.encode(caption(j), 16)[0]
    assert torch.equal(s.image, ds[j].image)
    batch = Collator(tok.pad_id, 16, 8)([ds[i] for i in range(len(ds))])
    assert len(batch) == len(ds)
    assert set(k for k, _ in batch.errors) == set(bad)


def test_on_error_fail_raises_on_the_first_bad_sample(tmp_path, tok):
    rows = good_rows(tmp_path, 2) + [{"id": "gone", "image": "img/nope.png", "text": "x"}]
    ds = build_dataset(cfg(str(write_jsonl(tmp_path / "m.jsonl", rows)), on_error="fail"), "train", tok)
    assert ds[0].key == "r0"
    with pytest.raises(DataError, match=r"bad sample 'gone' \(m.jsonl:3\): image file not found(.|\n)*on_error: skip"):
        ds[2]


def test_on_error_decides_about_malformed_lines(tmp_path, tok):
    m = str(write_jsonl(tmp_path / "m.jsonl", good_rows(tmp_path, 2) + ["{oops"]))
    with pytest.raises(DataError, match=r"m.jsonl:3: not JSON"):
        build_dataset(cfg(m, on_error="fail"), "train", tok)
    assert len(build_dataset(cfg(m, on_error="skip"), "train", tok)) == 2


def test_all_bad_source_fails_fast_with_a_clear_error(tmp_path, tok):
    rows = [{"id": f"x{i}", "image": f"nowhere/{i}.jpg", "text": "t"} for i in range(10_000)]
    good = good_rows(tmp_path, 3)
    c = DataConfig(
        train=[SourceSpec(str(write_jsonl(tmp_path / "good.jsonl", good))),
               SourceSpec(str(write_jsonl(tmp_path / "bad.jsonl", rows)))],
        image_size=8,
    )
    ds = build_dataset(c, "train", tok)
    assert ds[0].key == "r0"
    start = time.monotonic()
    with pytest.raises(DataError, match=rf"bad.jsonl: {MAX_TRIES} samples in a row failed(.|\n)*image file not found(.|\n)*vltrain data validate"):
        ds[5000]
    assert time.monotonic() - start < 30  # bounded, not a loop over 10,000 files


def test_source_with_only_malformed_rows_is_refused(tmp_path, tok):
    m = str(write_jsonl(tmp_path / "m.jsonl", ["{x", "[]"]))
    with pytest.raises(DataError, match=r"no usable samples \(2 malformed row\(s\) dropped, first: m.jsonl:1"):
        build_dataset(cfg(m), "train", tok)


def test_text_edge_cases(tmp_path, tok):
    long = "left " * 20_000  # 100,000 characters
    rows = [
        {"id": "long", "text": long},
        {"id": "unicode", "text": "ünïcödé 红色 circle 🚀"},
        {"id": "empty", "image": str(save(distinct_image(1), tmp_path / "e.png")), "text": ""},
    ]
    ds = build_dataset(cfg(str(write_jsonl(tmp_path / "m.jsonl", rows))), "train", tok)
    s = ds[0]
    assert len(s.input_ids) == 16 and s.truncated
    assert ds[1].input_ids[0] == tok.cls_id and not ds[1].truncated
    assert ds[2].input_ids == [] and ds[2].image is not None
    batch = Collator(tok.pad_id, 16, 8)([ds[i] for i in range(3)])
    assert batch.num_truncated == 1
    assert batch.has_text.tolist() == [True, True, False]


def one_bad_short_row(tmp_path) -> tuple[DataConfig, int]:
    """Text-only and image-text rows with long captions, then one bad image-text row with a short one."""
    rows = [{"id": f"t{i}", "text": caption(i)} for i in range(20)]  # text-only, longer captions
    rows += [{"id": f"s{i}", "image": f"img/{i}.png", "text": caption(i) + " " + caption(i + 1)}
             for i in range(20)]  # image-text, longer captions
    for i in range(20):
        save(distinct_image(i), tmp_path / "img" / f"{i}.png")
    rows.append({"id": "short", "image": "img/missing.png", "text": "red"})  # bad, image + short caption
    return cfg(str(write_jsonl(tmp_path / "m.jsonl", rows))), len(rows) - 1


def test_a_replacement_fits_the_plan_of_the_sample_it_replaces(tmp_path, tok):
    """Budget batches are planned from the table: a replacement keeps the planned modalities and
    at most the planned token count, so it cannot push a batch over its budget."""
    c, planned = one_bad_short_row(tmp_path)
    ds = build_dataset(c, "train", tok, plan_aware=True)
    t = ds.table()
    s = ds[planned]
    assert s.errors and s.errors[0][0] == "short"
    assert s.image is not None and s.key.startswith("s")  # same modalities as planned
    assert 0 < len(s.input_ids) <= t.text_len[planned] and s.truncated
    assert s.input_ids[-1] == tok.encode(caption(0), 16)[0][-1]  # the closing token is kept


def test_plan_aware_replacement_is_an_argument_not_a_side_effect_of_table(tmp_path, tok):
    c, planned = one_bad_short_row(tmp_path)
    plain = build_dataset(c, "train", tok)
    before = plain[planned]
    plain.table()  # the training loader's first call: it no longer switches the dataset
    after = plain[planned]
    assert not plain.plan_aware
    assert (after.key, after.input_ids, after.truncated) == (before.key, before.input_ids, before.truncated)
    fitted = build_dataset(c, "train", tok, plan_aware=True)[planned]  # no table() call first
    assert fitted.image is not None and fitted.key.startswith("s") and fitted.truncated
    assert fitted.key != after.key


def test_native_shape_samples_and_their_bad_inputs(tmp_path, tok):
    """data.resize native: a 1 x 4000 strip and a 16 x 16 thumbnail are samples like any other; an image
    over data.max_image_pixels is a counted bad sample, replaced; the batch pads or packs them."""
    from PIL import Image

    rows = good_rows(tmp_path, 4)
    for name, size in (("strip", (4000, 1)), ("thumb", (16, 16)), ("huge", (3000, 3000))):
        Image.new("RGB", size, (200, 10, 10)).save(tmp_path / "img" / f"{name}.png")
        rows.append({"id": name, "image": f"img/{name}.png", "text": "red"})
    m = str(write_jsonl(tmp_path / "m.jsonl", rows))
    c = cfg(m, resize="native", max_patches=16, patch_size=4, max_image_pixels=1_000_000)
    ds = build_dataset(c, "train", tok)
    strip, thumb, huge = ds[4], ds[5], ds[6]
    assert strip.grid == (1, 16) and strip.image.shape == (16, 48) and strip.errors == []
    assert thumb.grid == (4, 4) and thumb.image.shape == (16, 48)  # enlarged to the budget (upscale)
    assert huge.key != "huge" and huge.errors[0][0] == "huge" and "data.max_image_pixels" in huge.errors[0][1]
    samples = [ds[i] for i in range(len(ds))]
    padded = Collator.for_data(tok.pad_id, c)(samples)
    assert padded.images.pixels.shape == (7, 16, 48) and padded.images.grids[4].tolist() == [1, 16]
    assert [k for k, _ in padded.errors] == ["huge"]
    packed = Collator.for_data(tok.pad_id, DataConfig(**{**vars(c), "pack_images": True}))(samples)
    real = sum(int(g.prod()) for g in packed.images.grids)
    assert int((packed.images.segments >= 0).sum()) == real and packed.images.pixels.shape[1:] == (16, 48)
