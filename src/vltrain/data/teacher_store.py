"""A teacher's embeddings of every row of a source, stored beside its sample index (MobileCLIP's
"dataset reinforcement"): made once by ``vltrain data teacher-embed``, then read by the training
loader instead of running the teacher (``model.teacher.precomputed``).

One folder per (source index, teacher): ``INDEX/teacher-KEY/``, KEY a hash of the teacher's
identity (:func:`teacher_key`). It holds

- ``meta.json``: the teacher's identity, the index it belongs to, the row count, the width, the
  dtype and the teacher's temperature (and SigLIP bias);
- ``image.npy``, ``text.npy``: [rows, width] memory-mapped arrays, zeros where a row lacks that side;
- ``missing.npy``: [rows] bool, the rows the teacher could not read (their image could not be read or
  decoded, or the row itself): their embeddings are not stored, the training loader replaces them as
  bad samples, and ``vltrain data teacher-embed`` run again tries them again. A store made before
  this file existed has none: there a row with an image whose image embedding is all zeros was one
  the teacher could not read (a teacher's embedding is never zero), and that is what it counts as;
- ``uid.npy``: [rows] int64, each row's sample id (``stable_uid`` of its key), written with its
  embeddings: a row is read only if its id is the one the loader reads;
- ``done.npy``: [chunks] bool, the chunks of ``chunk`` rows (meta.json's) written so far: what a
  resumed pass skips.

Rows written by different processes are disjoint, so ranks fill one store side by side. The index
folder already names its source's files (their sizes and times): the embeddings of another source,
or of a changed one, live in another index folder and are never read for this one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vltrain.errors import DataError

if TYPE_CHECKING:
    from vltrain.data.config import DataConfig
    from vltrain.data.tokenizers import Tokenizer

log = logging.getLogger(__name__)

CHUNK = 1024
"""Rows per unit of work (and of resumption) of the embedding pass, unless it is given another."""
DTYPE = "float16"
"""How the embeddings are stored, unless the pass is given another."""


class MissingRow(Exception):
    """A row the teacher could not read when its embeddings were stored: the loader replaces the
    sample as it does one whose image cannot be read (``bad_samples.jsonl``)."""


def teacher_key(identity: dict) -> str:
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=6).hexdigest()


def store_dir(index_dir: Path, identity: dict) -> Path:
    return Path(index_dir) / f"teacher-{teacher_key(identity)}"


@dataclass
class StoreMeta:
    teacher: dict
    """The teacher's identity (``vltrain.train.teacher.teacher_identity``)."""
    index: str
    """The sample index's folder name (its source and key)."""
    rows: int
    width: int
    dtype: str
    scale: float
    """The teacher's inverse temperature, exp(logit_scale)."""
    bias: float | None
    chunk: int = CHUNK
    """Rows per chunk: the unit of work a rank takes, and of resumption."""

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)


class TeacherStore:
    """One source's stored teacher embeddings, opened for reading or for filling in."""

    def __init__(self, folder: Path, meta: StoreMeta, writable: bool = False):
        self.folder, self.meta, self.writable = Path(folder), meta, writable
        self._map()

    def _map(self) -> None:
        mode = "r+" if self.writable else "r"
        self.image = np.load(self.folder / "image.npy", mmap_mode=mode)
        self.text = np.load(self.folder / "text.npy", mmap_mode=mode)
        self.uid = np.load(self.folder / "uid.npy", mmap_mode=mode)
        self.done = np.load(self.folder / "done.npy", mmap_mode=mode)
        marks = self.folder / "missing.npy"
        self.missing = np.load(marks, mmap_mode=mode) if marks.exists() else None
        """None in a store made before missing rows were marked (:meth:`lacks`)."""

    def __getstate__(self) -> dict:
        """To a loader worker: the folder, mapped again there (a pickled map would copy the arrays)."""
        return {"folder": self.folder, "meta": self.meta, "writable": self.writable}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._map()

    @property
    def chunks(self) -> int:
        return len(self.done)

    @staticmethod
    def create(folder: Path, meta: StoreMeta) -> "TeacherStore":
        """A new, empty store (or the one already there, made for the same teacher and index)."""
        folder = Path(folder)
        found = _read_meta(folder)
        if found is not None:
            if (found.teacher, found.index, found.rows, found.width, found.dtype, found.chunk) == \
                    (meta.teacher, meta.index, meta.rows, meta.width, meta.dtype, meta.chunk):
                return TeacherStore(folder, found, writable=True)
            raise DataError(f"{folder} holds teacher embeddings made otherwise ({found.rows} rows of width "
                            f"{found.width}, {found.dtype}, chunks of {found.chunk}); give the same settings to "
                            f"resume it (--chunk-rows {found.chunk} --dtype {found.dtype}), or remove it to make them "
                            "again")
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("image", "text"):
            np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=meta.dtype,
                                      shape=(meta.rows, meta.width)).flush()
        np.lib.format.open_memmap(folder / "uid.npy", mode="w+", dtype=np.int64, shape=(meta.rows,)).flush()
        np.save(folder / "missing.npy", np.zeros(meta.rows, dtype=bool))
        np.save(folder / "done.npy", np.zeros(-(-meta.rows // meta.chunk), dtype=bool))
        tmp = folder / "meta.json.tmp"
        tmp.write_text(meta.to_json())
        tmp.replace(folder / "meta.json")
        return TeacherStore(folder, meta, writable=True)

    def mark_missing(self, has_image: np.ndarray) -> None:
        """Write ``missing.npy`` into a store made before it existed: the rows with an image (``has_image``,
        the source index's) whose image embedding is all zeros (:meth:`lacks`), read a chunk at a time."""
        lacking = np.zeros(self.meta.rows, dtype=bool)
        for lo in range(0, self.meta.rows, self.meta.chunk):
            hi = lo + self.meta.chunk
            lacking[lo:hi] = np.asarray(has_image[lo:hi]) & ~np.any(self.image[lo:hi], axis=1)
        tmp = self.folder / "missing.tmp.npy"
        np.save(tmp, lacking)
        tmp.replace(self.folder / "missing.npy")
        self._map()

    def write(self, chunk: int, image: np.ndarray, text: np.ndarray, uid: np.ndarray, missing: np.ndarray) -> None:
        """Chunk ``chunk``'s rows (``missing``: those the teacher could not read), flushed before the
        chunk is marked done."""
        lo = chunk * self.meta.chunk
        self.put(np.arange(lo, lo + len(uid)), image, text, uid, missing)
        self.done[chunk] = True
        self.done.flush()

    def put(self, rows: np.ndarray, image: np.ndarray, text: np.ndarray, uid: np.ndarray, missing: np.ndarray) -> None:
        """These rows' embeddings, flushed before their marks: a row read again is marked as read only
        once its embeddings are on disk. A row still missing keeps zeros."""
        keep = ~np.asarray(missing, dtype=bool)[:, None]
        self.image[rows] = np.where(keep, image, 0)
        self.text[rows] = np.where(keep, text, 0)
        self.uid[rows] = uid
        for a in (self.image, self.text, self.uid):
            a.flush()
        self.missing[rows] = missing
        self.missing.flush()

    def lacks(self, j: int, has_image: bool) -> bool:
        """Whether row ``j`` is one the teacher could not read: marked so, or in a store made before
        the marks, a row with an image whose image embedding is all zeros."""
        if self.missing is not None:
            return bool(self.missing[j])
        return has_image and not np.any(self.image[j])

    def row(self, j: int, uid: int, has_image: bool, has_text: bool, where: str
            ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Row ``j``'s (image, text) embeddings as float32 (None for a side it lacks); ``where`` names
        the row in an error. Refuses a row not yet embedded, or one that holds another sample; a row the
        teacher could not read raises :class:`MissingRow`."""
        written = bool(self.done[j // self.meta.chunk])
        if written and self.lacks(j, has_image):  # never read, so its id was never read either
            raise MissingRow("the teacher could not read it when they were made; `vltrain data teacher-embed` run "
                             "again fills the row in once it is readable")
        if not written or int(self.uid[j]) != uid:
            what = "has no teacher embeddings yet" if not written else \
                "holds the embeddings of another sample (the source changed since they were made)"
            raise DataError(f"{where} {what} in {self.folder}: run `vltrain data teacher-embed` again for this "
                            "source and teacher (it resumes where it stopped)")
        image = np.asarray(self.image[j], dtype=np.float32) if has_image else None
        text = np.asarray(self.text[j], dtype=np.float32) if has_text else None
        return image, text


def _read_meta(folder: Path) -> StoreMeta | None:
    try:
        return StoreMeta(**json.loads((Path(folder) / "meta.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def open_store(index_dir: Path, identity: dict, source: str, rows: int) -> TeacherStore:
    """The complete store of ``identity``'s embeddings for the source indexed at ``index_dir``;
    a clear error naming the source and what to run when there is none, or it is incomplete, or it
    was made for other rows."""
    folder = store_dir(index_dir, identity)
    meta = _read_meta(folder)
    run = embed_command(identity.get("path", "TEACHER"), source, meta)
    if meta is None:
        others = sorted(p.name for p in Path(index_dir).glob("teacher-*"))
        also = (f" (it has embeddings of other teachers: {', '.join(others)}; model.teacher.path must name the "
                "teacher that made them, unchanged)") if others else ""
        raise DataError(f"{source}: no stored embeddings of teacher {identity.get('path')} beside its sample index "
                        f"{index_dir}{also}. Make them with `{run}`, or set model.teacher.precomputed false to run "
                        "the teacher live")
    store = TeacherStore(folder, meta)
    if meta.rows != rows or meta.index != Path(index_dir).name:
        raise DataError(f"{folder}: embeddings of {meta.rows} rows of index {meta.index}, but the source has {rows} "
                        f"rows in index {Path(index_dir).name}; make them again with `{run}`")
    missing = int((~np.asarray(store.done)).sum())
    if missing:
        raise DataError(f"{source}: the teacher embeddings in {folder} are incomplete ({missing} of {store.chunks} "
                        f"chunks missing); finish them with `{run}` (it resumes)")
    lacking = int(np.count_nonzero(store.missing)) if store.missing is not None else 0
    if lacking:
        log.info("%s: %d row(s) the teacher could not read have no stored embeddings: training replaces them as "
                 "bad samples (bad_samples.jsonl); once they are readable, `%s` fills them in", source, lacking, run)
    return store


def embed_command(teacher: str, source: str, meta: StoreMeta | None) -> str:
    """The ``vltrain data teacher-embed`` line that makes, finishes or fills the store ``meta`` describes:
    with the chunk size and dtype it was made with, which a resumed pass must repeat."""
    given = "" if meta is None else "".join(
        f" {flag} {value}" for flag, value, default in (("--chunk-rows", meta.chunk, CHUNK),
                                                      ("--dtype", meta.dtype, DTYPE)) if value != default)
    return f"vltrain data teacher-embed {teacher} {source}{given}"


@dataclass
class TeacherInputs:
    """What a dataset makes for a distillation teacher beside each student sample: for a teacher that
    runs (``data``, ``tokenizer``) its own view of the same decoded image and caption; for stored
    embeddings (``stores``, one per source) the row's embeddings."""

    data: "DataConfig | None" = None
    """The teacher's preprocessing (image size, resize, statistics, text length) on the student's
    decoding settings (:func:`teacher_data`)."""
    tokenizer: "Tokenizer | None" = None
    stores: list[TeacherStore] | None = None

    @property
    def width(self) -> int:
        return self.stores[0].meta.width if self.stores else 0

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_constants"}

    def constants(self, device) -> tuple:
        """The stored teacher's (scale, bias) as 0-dim fp32 tensors on ``device``, made once."""
        import torch

        cached = self.__dict__.setdefault("_constants", {})
        if device not in cached:
            meta = self.stores[0].meta
            bias = None if meta.bias is None else torch.tensor(meta.bias, dtype=torch.float32, device=device)
            cached[device] = (torch.tensor(meta.scale, dtype=torch.float32, device=device), bias)
        return cached[device]
