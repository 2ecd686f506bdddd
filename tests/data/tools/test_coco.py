"""``vltrain data from-coco`` on files in COCO's own format: instances and captions as COCO ships
them (info, licenses, segmentation, area, iscrowd, ...), RefCOCO's refs as JSON records."""

import json

import numpy as np
import pytest
from kits.datafiles import run_cli, save, tiny_tokenizer
from PIL import Image

from vltrain.data.config import DataConfig
from vltrain.data.dataset import build_dataset
from vltrain.data.tools.coco import from_coco
from vltrain.errors import DataError, UsageError

INFO = {"description": "COCO 2014 Dataset", "url": "http://cocodataset.org", "version": "1.0", "year": 2014,
        "contributor": "COCO Consortium", "date_created": "2017/09/01"}
LICENSES = [{"url": "http://creativecommons.org/licenses/by-nc-sa/2.0/", "id": 1,
             "name": "Attribution-NonCommercial-ShareAlike License"}]


def _image(image_id: int, width: int, height: int) -> dict:
    name = f"COCO_train2014_{image_id:012d}.jpg"
    return {"license": 1, "file_name": name, "coco_url": f"http://images.cocodataset.org/train2014/{name}",
            "height": height, "width": width, "date_captured": "2013-11-14 16:28:13",
            "flickr_url": "http://farm4.staticflickr.com/x.jpg", "id": image_id}


def _ann(ann_id: int, image_id: int, bbox: list, category: int, crowd: int = 0) -> dict:
    x, y, w, h = bbox
    return {"segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]], "area": w * h, "iscrowd": crowd,
            "image_id": image_id, "bbox": bbox, "category_id": category, "id": ann_id}


@pytest.fixture
def coco(tmp_path):
    """Three images (one never referred to), five annotations (one a crowd, one running a fraction of
    a pixel past its image), captions, and refs of two splits."""
    images = [_image(9, 64, 48), _image(25, 40, 40), _image(30, 32, 32)]
    for im in images:
        save(Image.new("RGB", (im["width"], im["height"]), (90, 90, 90)), tmp_path / "train2014" / im["file_name"])
    instances = {"info": INFO, "licenses": LICENSES, "images": images, "annotations": [
        _ann(101, 9, [4.5, 6.25, 20.0, 10.0], 1), _ann(102, 9, [30.0, 20.0, 34.4, 28.0], 18),
        _ann(103, 9, [0, 0, 64, 48], 1, crowd=1), _ann(104, 25, [10, 10, 20, 25], 18), _ann(105, 30, [1, 1, 5, 5], 1)],
        "categories": [{"supercategory": "person", "id": 1, "name": "person"},
                       {"supercategory": "animal", "id": 18, "name": "dog"}]}
    captions = {"info": INFO, "licenses": LICENSES, "images": images, "annotations": [
        {"image_id": 9, "id": 48, "caption": "A man walking a dog."},
        {"image_id": 9, "id": 67, "caption": "A person and a dog outside."},
        {"image_id": 25, "id": 12, "caption": "A dog sitting."}]}
    refs = [{"sent_ids": [0, 1], "file_name": "COCO_train2014_000000000009_101.jpg", "ann_id": 101, "ref_id": 0,
             "image_id": 9, "split": "train", "category_id": 1,
             "sentences": [{"tokens": ["man", "on", "left"], "raw": "Man on left", "sent_id": 0, "sent": "man on left"},
                           {"tokens": ["the", "walker"], "raw": "the walker", "sent_id": 1, "sent": "the walker"}]},
            {"sent_ids": [2], "file_name": "COCO_train2014_000000000025_104.jpg", "ann_id": 104, "ref_id": 1,
             "image_id": 25, "split": "val", "category_id": 18,
             "sentences": [{"tokens": ["dog"], "raw": "Dog.", "sent_id": 2, "sent": "dog"}]}]
    paths = {}
    for name, doc in (("instances_train2014.json", instances), ("captions_train2014.json", captions),
                      ("refs.json", refs)):
        paths[name] = tmp_path / "annotations" / name
        paths[name].parent.mkdir(exist_ok=True)
        paths[name].write_text(json.dumps(doc))
    return paths


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_instances_refs_and_captions_become_rows_with_regions(coco, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "data", "from-coco", "--instances", coco["instances_train2014.json"],
                             "--refs", coco["refs.json"], "--captions", coco["captions_train2014.json"],
                             "--images", "train2014", "--out", "out/coco.jsonl")
    assert code == 0, err
    assert "wrote 3 rows (3 images) to out/coco.jsonl: 5 regions, 3 with a referring phrase and 2 named" in out
    assert "left out 1 crowd annotation(s) and 0 box(es) with no area in their image; clipped 1 box(es)" in out
    rows = _rows(tmp_path / "out" / "coco.jsonl")
    assert rows[0] == {"id": 9, "image": "../train2014/COCO_train2014_000000000009.jpg", "text": "A man walking a dog.",
                       "regions": [{"box": [4.5, 6.25, 24.5, 16.25], "text": "man on left"},
                                   {"box": [4.5, 6.25, 24.5, 16.25], "text": "the walker"},
                                   {"box": [30.0, 20.0, 64.0, 48.0], "text": "dog"}]}  # clipped at 64
    assert rows[1]["regions"] == [{"box": [10, 10, 30, 35], "text": "dog"}] and rows[1]["text"] == "A dog sitting."
    assert "text" not in rows[2] and rows[2]["regions"] == [{"box": [1, 1, 6, 6], "text": "person"}]
    code, out, _ = run_cli(capsys, "data", "validate", "out/coco.jsonl")
    assert code == 0, out
    tok = tiny_tokenizer(tmp_path)
    ds = build_dataset(DataConfig(train="out/coco.jsonl", image_size=16, resize="squash", max_text_length=16),
                       "train", tok)
    np.testing.assert_allclose(ds[0].regions.boxes[0], [4.5 / 64, 6.25 / 48, 24.5 / 64, 16.25 / 48], atol=1e-6)


def test_a_split_keeps_its_refs_and_their_images_and_captions_may_each_make_a_row(coco, tmp_path):
    out = tmp_path / "val.jsonl"
    r = from_coco(coco["instances_train2014.json"], tmp_path / "train2014", out, refs=coco["refs.json"], split="val")
    assert (r.rows, r.referring, r.named) == (1, 1, 0)
    assert _rows(out) == [{"id": 25, "image": "train2014/COCO_train2014_000000000025.jpg",
                           "regions": [{"box": [10, 10, 30, 35], "text": "dog"}]}]
    r = from_coco(coco["instances_train2014.json"], tmp_path / "train2014", out,
                  captions=coco["captions_train2014.json"], all_captions=True)
    rows = _rows(out)
    assert r.rows == len(rows) == 4 and [x["id"] for x in rows] == [9, 9, 25, 30]
    assert [x["text"] for x in rows[0]["regions"]] == ["dog", "person"]  # no refs: category names, largest first
    assert [x["text"] for x in rows[:2]] == ["A man walking a dog.", "A person and a dog outside."]


@pytest.mark.parametrize("edit, says", [
    (lambda i, r: i.pop("annotations"), 'instances_train2014.json: no "annotations" list'),
    (lambda i, r: i["annotations"][1].update(bbox=[1, 2, 3]),
     'instances_train2014.json: "annotations"[1]: "bbox" must be 4 numbers [x, y, width, height], got [1, 2, 3]'),
    (lambda i, r: i["annotations"][3].update(image_id=77),
     'instances_train2014.json: "annotations"[3]: "image_id" 77 is not in "images"'),
    (lambda i, r: i["annotations"][0].update(category_id=5),
     'instances_train2014.json: "annotations"[0]: "category_id" 5 is not in "categories"'),
    (lambda i, r: i["images"][2].pop("file_name"),
     'instances_train2014.json: "images"[2]: "file_name" must be str, got null'),
    (lambda i, r: r[1].update(ann_id=999), 'refs.json: [1]: "ann_id" 999 is not in the instances\' "annotations"'),
    (lambda i, r: r[0]["sentences"][1].pop("sent") and r[0]["sentences"][1].pop("raw"),
     'refs.json: [0]: "sentences"[1]: "raw" must be str, got null'),
])
def test_a_malformed_file_is_named_with_its_key(coco, tmp_path, edit, says):
    instances = json.loads(coco["instances_train2014.json"].read_text())
    refs = json.loads(coco["refs.json"].read_text())
    edit(instances, refs)
    coco["instances_train2014.json"].write_text(json.dumps(instances))
    coco["refs.json"].write_text(json.dumps(refs))
    with pytest.raises(DataError) as e:
        from_coco(coco["instances_train2014.json"], tmp_path / "train2014", tmp_path / "o.jsonl",
                  refs=coco["refs.json"])
    assert str(e.value).startswith(says), str(e.value)
    assert not (tmp_path / "o.jsonl").exists()


def test_missing_files_and_a_split_without_refs_are_usage_errors(coco, tmp_path, capsys):
    with pytest.raises(UsageError, match="--instances .*nowhere.json: not found"):
        from_coco(tmp_path / "nowhere.json", tmp_path / "train2014", tmp_path / "o.jsonl")
    with pytest.raises(UsageError, match="--images .*: not a folder"):
        from_coco(coco["instances_train2014.json"], tmp_path / "nope", tmp_path / "o.jsonl")
    code, _, err = run_cli(capsys, "data", "from-coco", "--instances", coco["instances_train2014.json"], "--images",
                           tmp_path / "train2014", "--out", tmp_path / "o.jsonl", "--split", "val")
    assert code == 2 and "--split picks the refs of one split: give --refs too" in err and "Traceback" not in err
