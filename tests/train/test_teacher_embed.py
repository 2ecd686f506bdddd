"""``vltrain data teacher-embed`` as a user meets it when an image cannot be read: the row is stored
as missing, training with ``model.teacher.precomputed`` replaces it as a bad sample (logged with its
key), the next pass fills it in once the file is back, and the commands vltrain prints to finish a
store work as printed."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
from kits.pretrainedkit import make_clip
from kits.runkit import ok, overrides, session_shapes

ROWS = 16


def _data(shapes: Path, root: Path) -> tuple[Path, str, Path]:
    """The shapes' first rows, each image copied beside the manifest; the key and image of the first row
    that has an image."""
    rows = [json.loads(x) for x in (shapes / "train.jsonl").read_text().splitlines()[:ROWS]]
    for row in rows:
        if row.get("image"):
            (root / row["image"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(shapes / row["image"], root / row["image"])
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = next(r for r in rows if r.get("image"))
    return root / "train.jsonl", first["id"], root / first["image"]


def _vltrain(cli, command: str):
    """A command as vltrain printed it, run as printed."""
    words = shlex.split(command)
    assert words[0] == "vltrain", command
    return cli(*words[1:])


@pytest.mark.timeout(600)
def test_an_unreadable_row_is_stored_missing_replaced_in_training_and_filled_in_later(tmp_path_factory, tmp_path,
                                                                                         cli):
    shapes = session_shapes(tmp_path_factory)
    teacher = tmp_path_factory.getbasetemp() / "hf-clip-teacher-0"
    if not (teacher / "config.json").exists():
        make_clip(teacher, seed=0)
    manifest, key, image = _data(shapes, tmp_path / "data")
    saved = image.read_bytes()
    image.unlink()
    made = ok(cli("data", "teacher-embed", teacher, manifest, "--chunk-rows", "8", "--batch-size", "8", "--workers",
                  "0", "--dtype", "float32"))
    assert "1 row(s) the teacher could not read, stored as missing" in made.stdout
    (store,) = (manifest.parent / ".vltrain-index").glob("train.jsonl-*/teacher-*")
    missing = np.load(store / "missing.npy")
    assert missing.sum() == 1 and not np.load(store / "image.npy")[missing].any()

    image.write_bytes(saved)  # the file is back: training still replaces the row, and says how to fill it
    distil = {"data__train": manifest, "data__image_size": 48, "data__num_workers": 0, "train__max_steps": 4,
              "checkpoint__every": 0, "model__loss__distill": 1, "model__teacher__path": teacher,
              "model__teacher__precomputed": "true"}
    run = tmp_path / "run"
    proc = ok(cli("train", shapes / "base.yaml", *overrides(shapes, run, **distil)))
    assert "bad samples: 1 replaced" in proc.stdout + proc.stderr
    (bad,) = [json.loads(x) for x in (run / "bad_samples.jsonl").read_text().splitlines()]
    assert bad["key"] == key and "no stored teacher embeddings" in bad["reason"]
    (fill,) = [line.split("`")[1] for line in proc.stderr.splitlines() if "could not read have no stored" in line]
    assert fill.endswith("--chunk-rows 8 --dtype float32"), fill

    filled = ok(_vltrain(cli, fill))
    assert "embedded 0 chunk(s) (1 rows, 2 chunk(s) done before)" in filled.stdout
    assert "0 row(s) the teacher could not read" in filled.stdout and "filled 1 row(s) missing before" in filled.stdout
    assert not np.load(store / "missing.npy").any()
    assert abs(np.linalg.norm(np.load(store / "image.npy")[missing]) - 1) < 1e-3  # an embedding, not zeros
    again = ok(cli("train", shapes / "base.yaml", *overrides(shapes, tmp_path / "again", **distil)))
    assert "bad samples" not in again.stdout + again.stderr and not (tmp_path / "again" / "bad_samples.jsonl").exists()

    done = np.load(store / "done.npy", mmap_mode="r+")
    done[1] = False  # a pass that stopped before its last chunk: training names the command that finishes it
    done.flush()
    refused = cli("train", shapes / "base.yaml", *overrides(shapes, tmp_path / "early", **distil))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    finish = refused.stderr.split("finish them with `")[1].split("`")[0]
    finished = ok(_vltrain(cli, finish))
    assert "embedded 1 chunk(s) (8 rows, 1 chunk(s) done before)" in finished.stdout
