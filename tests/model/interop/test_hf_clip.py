"""Reading a Hugging Face image processor's filter: the one table of :mod:`vltrain.pixels`."""

from __future__ import annotations

from pathlib import Path

from vltrain.model.interop.hf_clip import _interpolation


def test_a_processors_resample_becomes_data_interpolation():
    """Pillow's 2 and 3 are bilinear and bicubic; absent, the family's default; any other filter
    (lanczos, an unknown code) is noted and the default used, as before the table was shared."""
    path = Path("preprocessor_config.json")
    notes: list[str] = []
    assert _interpolation({"resample": 2}, path, "bicubic", notes) == "bilinear"
    assert _interpolation({"resample": 3}, path, "bilinear", notes) == "bicubic"
    assert _interpolation({}, path, "bicubic", notes) == "bicubic" and notes == []
    assert _interpolation({}, path, "bilinear", notes) == "bilinear" and notes == []
    assert _interpolation({"resample": 1}, path, "bilinear", notes) == "bilinear"
    assert _interpolation({"resample": 9}, path, "bicubic", notes) == "bicubic"
    assert notes == ["preprocessor_config.json: resample 1 is neither bilinear nor bicubic; bilinear is used",
                     "preprocessor_config.json: resample 9 is neither bilinear nor bicubic; bicubic is used"]
