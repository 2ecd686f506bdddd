"""Referring-expression sets and their metrics, and boxes mapped between the model's view and the
image's pixels (vltrain.eval.grounding)."""

import json

import pytest
import torch
from PIL import Image

from vltrain.errors import UserError
from vltrain.eval.grounding import (
    from_image_pixels,
    open_referring,
    referring_scores,
    to_image_pixels,
    view_window,
)


def test_the_window_is_the_center_crop_or_the_whole_image(tmp_path):
    wide = tmp_path / "wide.png"
    Image.new("RGB", (100, 60)).save(wide)
    assert view_window(str(wide), "crop") == (20.0, 0.0, 80.0, 60.0)
    assert view_window(str(wide), "squash") == (0.0, 0.0, 100.0, 60.0)
    assert view_window(str(wide), "native") == (0.0, 0.0, 100.0, 60.0)


def test_an_exif_turned_image_is_measured_as_shown(tmp_path):
    turned = tmp_path / "turned.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 100 x 60, shown a quarter turned: 60 x 100
    Image.new("RGB", (100, 60)).save(turned, exif=exif)
    assert view_window(str(turned), "squash") == (0.0, 0.0, 60.0, 100.0)


def test_boxes_go_to_pixels_and_back():
    windows = [(20.0, 0.0, 80.0, 60.0), (0.0, 0.0, 100.0, 50.0)]
    seen = torch.tensor([[0.0, 0.5, 0.5, 1.0], [0.25, 0.2, 0.75, 0.4]])
    pixels = to_image_pixels(seen, windows)
    assert pixels.tolist() == [[20.0, 30.0, 50.0, 60.0], [25.0, 10.0, 75.0, 20.0]]
    assert torch.allclose(from_image_pixels(pixels, windows), seen)


def test_acc50_and_mean_iou():
    truth = torch.tensor([[0.0, 0.0, 10.0, 10.0]] * 3)
    predicted = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 5.0], [20.0, 20.0, 30.0, 30.0]])
    scores = referring_scores(predicted, truth)
    assert scores["acc50"] == pytest.approx(2 / 3)  # IoU 1, 0.5 (counted: >= 0.5), 0
    assert scores["miou"] == pytest.approx(0.5)


def test_a_referring_file_is_read_and_its_bad_rows_named(tmp_path):
    good = tmp_path / "ref.jsonl"
    good.write_text(json.dumps({"image": "a.png", "text": "the red circle", "box": [1, 2, 3, 4]}) + "\n\n")
    ref = open_referring("ref", good)
    assert ref.images == [str(tmp_path / "a.png")] and ref.texts == ["the red circle"]
    assert ref.boxes.tolist() == [[1.0, 2.0, 3.0, 4.0]]
    for row, said in ((({"image": "a.png", "text": "x", "box": [3, 2, 1, 4]}), "x0 < x1"),
                      ({"image": "a.png", "text": " ", "box": [1, 2, 3, 4]}, "non-empty"),
                      ({"image": "a.png", "text": "x", "box": ["a", 2, 3, 4]}, "a referring row is"),
                      ({"image": "a.png", "box": [1, 2, 3, 4]}, "a referring row is")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"image": "a.png", "text": "fine", "box": [0, 0, 1, 1]}) + "\n" + json.dumps(row))
        with pytest.raises(UserError, match=f"bad.jsonl:2: .*{said}"):
            open_referring("bad", bad)
