"""Stored teacher embeddings know what they lack: a row the teacher could not read is marked missing
(not left as zeros that read as an embedding), in stores made before the marks too, and the command
that finishes a store repeats the settings it was made with."""

from __future__ import annotations

import numpy as np
import pytest

from vltrain.data.teacher_store import MissingRow, StoreMeta, TeacherStore, embed_command

ROWS, WIDTH, CHUNK = 6, 4, 4


def _store(tmp_path, chunk: int = CHUNK, dtype: str = "float32") -> TeacherStore:
    meta = StoreMeta({"path": "teacher"}, "index", ROWS, WIDTH, dtype, 10.0, None, chunk)
    return TeacherStore.create(tmp_path / "store", meta)


def _unit(n: int) -> np.ndarray:
    x = np.arange(1, n * WIDTH + 1, dtype=np.float32).reshape(n, WIDTH)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_a_row_the_teacher_could_not_read_is_marked_missing_and_refused_as_a_bad_sample(tmp_path):
    store = _store(tmp_path)
    uid = np.arange(100, 100 + CHUNK)
    missing = np.array([False, True, False, False])
    store.write(0, _unit(CHUNK), _unit(CHUNK), uid, missing)
    assert np.load(tmp_path / "store" / "missing.npy").tolist() == [False, True] + [False] * 4
    assert not np.any(store.image[1]) and not np.any(store.text[1])  # nothing of it is stored
    image, text = store.row(0, 100, True, True, "row 0")
    np.testing.assert_allclose(image, _unit(CHUNK)[0])
    with pytest.raises(MissingRow, match="the teacher could not read it"):
        store.row(1, 12345, True, True, "row 1")  # its id was never read either: not 'another sample'

    store.put(np.array([1]), _unit(1), _unit(1), np.array([101]), np.array([False]))  # read again, filled
    assert not store.missing[1]
    np.testing.assert_allclose(store.row(1, 101, True, True, "row 1")[0], _unit(1)[0])


def test_a_store_made_before_the_marks_counts_a_zero_image_embedding_as_missing_and_can_be_marked(tmp_path):
    store = _store(tmp_path)
    image = _unit(CHUNK)
    image[2] = 0  # what the pass wrote for an image it could not read
    image[3] = 0  # a text-only row: no image embedding, and none missing
    store.write(0, image, _unit(CHUNK), np.arange(CHUNK), np.zeros(CHUNK, dtype=bool))
    (tmp_path / "store" / "missing.npy").unlink()
    old = TeacherStore(tmp_path / "store", store.meta)
    assert old.missing is None
    with pytest.raises(MissingRow):
        old.row(2, 2, True, True, "row 2")
    assert old.row(3, 3, False, True, "row 3")[0] is None

    writable = TeacherStore(tmp_path / "store", store.meta, writable=True)
    writable.mark_missing(np.array([True, True, True, False, True, True]))
    assert writable.missing[:CHUNK].tolist() == [False, False, True, False]


def test_the_command_that_finishes_a_store_repeats_its_chunk_size_and_dtype(tmp_path):
    assert embed_command("T", "a.jsonl", None) == "vltrain data teacher-embed T a.jsonl"
    assert embed_command("T", "a.jsonl", _store(tmp_path / "a", 1024, "float16").meta) == \
        "vltrain data teacher-embed T a.jsonl"
    assert embed_command("T", "a.jsonl", _store(tmp_path / "b", 2, "float32").meta) == \
        "vltrain data teacher-embed T a.jsonl --chunk-rows 2 --dtype float32"


def test_the_teachers_view_of_the_data_is_a_new_frozen_copy():
    """A decided config is never thawed: the teacher's data section is a frozen copy of the student's
    with the teacher's preprocessing, and the student's is left as it was."""
    from vltrain.data.config import DataConfig
    from vltrain.data.config import teacher_data
    from vltrain.types import freeze

    student = freeze(DataConfig(train="rows.jsonl", image_size=48, resize="native", pack_images=True, patch_budget=64,
                                batching="budget", max_patches=16, patch_size=8))
    teacher = freeze(DataConfig(image_size=32, mean=[0.5, 0.5, 0.5], tokenizer="teacher.json"))
    view = teacher_data(student, teacher)
    assert (view.train, view.image_size, view.mean, view.tokenizer) == ("rows.jsonl", 32, [0.5, 0.5, 0.5], "teacher.json")
    assert (view.pack_images, view.patch_budget) == (False, 0)
    assert (student.image_size, student.pack_images, student.patch_budget) == (48, True, 64)
    with pytest.raises(AttributeError, match="decided and frozen"):
        view.image_size = 64
