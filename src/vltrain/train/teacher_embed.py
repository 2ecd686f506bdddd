"""``vltrain data teacher-embed TEACHER SOURCES``: a teacher's image and text embeddings of every row,
stored beside each source's sample index (:mod:`vltrain.data.teacher_store`), so that a run with
``model.teacher.precomputed`` reads them and runs no teacher.

Each source's rows are cut into chunks (``--chunk-rows``, 1,024 by default); rank r of a ``torchrun`` world takes the
chunks c with c mod world = r and writes each as soon as it is embedded, so a pass that stops
(killed, preempted) resumes with the chunks still missing, on any number of ranks. The rows are
read as the training loader reads them for a teacher that runs: the same image bytes decoded at the
teacher's size with its resize and statistics (on the student's decoding limits when ``--config``
names the training config), the caption in the teacher's tokenizer. A row that cannot be read, or
whose image cannot be decoded, is stored as missing: the training loader replaces such a sample by
another row, and the next pass reads the missing rows of its finished chunks again (a file restored
in the meantime is then embedded).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from vltrain.config.job import JobConfig
from vltrain.data.config import DataConfig, teacher_data
from vltrain.data.dataset import Sample
from vltrain.data.ids import stable_uid
from vltrain.data.image_input import decode_for
from vltrain.data.images import ImageError
from vltrain.data.index.open import open_indexed
from vltrain.data.loading.collate import Collator
from vltrain.data.teacher_store import CHUNK, DTYPE, StoreMeta, TeacherStore, store_dir
from vltrain.errors import DataError, UserError
from vltrain.runtime.distributed import all_reduce_sum
from vltrain.runtime.precision import Precision
from vltrain.runtime.world import setup_world
from vltrain.compose.decide import locate_teacher
from vltrain.train.teacher import Teacher, teacher_identity

log = logging.getLogger(__name__)


@dataclass
class Pass:
    """One source's pass: its counts summed over the ranks."""

    source: str
    rows: int
    chunks: int
    done_before: int
    done_now: int
    rows_now: int
    unreadable: int
    """Rows this pass could not read (stored as missing), the missing rows it read again included."""
    filled: int
    """Rows stored as missing before that this pass could read."""
    seconds: float
    folder: str


class _Rows(torch.utils.data.Dataset):
    """Row ``j`` of one indexed source as the teacher takes it (a :class:`Sample`; ``source`` 1 marks
    an image that could not be read)."""

    def __init__(self, source, data: DataConfig, tokenizer):
        self.source, self.data, self.tokenizer = source, data, tokenizer

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, j: int) -> tuple[int, Sample]:
        try:
            row = self.source.row(j)
        except OSError:  # never read either: the training loader replaces a row it cannot read
            return j, Sample(0, "", None, [], False, 1)
        image, grid, bad = None, None, 0
        if row.image is not None:
            try:
                image, grid = decode_for(self.source.read_image(j), self.data)
            except (ImageError, OSError):
                bad = 1
        ids = []
        if row.text is not None:
            try:
                ids = self.tokenizer.encode(row.text, self.data.max_text_length)[0]
            except Exception as e:  # the tokenizers library raises a bare Exception (e.g. no unknown token)
                raise DataError(f"row {j} of {self.source.name} ({row.where}): the teacher's tokenizer "
                                f"{self.tokenizer.path} cannot read its caption ({e}); the teacher needs a "
                                "tokenizer that reads every caption of the data (one with an unknown token)") from None
        return j, Sample(stable_uid(row.key), row.key, image, ids, False, bad, grid=grid)


class _Collate:
    """(row indices, their batch, their samples)."""

    def __init__(self, collator: Collator):
        self.collator = collator

    def __call__(self, items: list[tuple[int, Sample]]):
        samples = [s for _, s in items]
        return [j for j, _ in items], self.collator(samples), samples


def _chunk_batches(chunks: list[int], rows: int, batch_size: int, chunk: int) -> list[list[int]]:
    """Batches of row indices, each inside one chunk of ``chunk`` rows, chunks in order."""
    out = []
    for c in chunks:
        lo, hi = c * chunk, min(rows, (c + 1) * chunk)
        out.extend(list(range(start, min(hi, start + batch_size))) for start in range(lo, hi, batch_size))
    return out


class Embedder:
    """The teacher, opened once, and the pass over one source at a time."""

    def __init__(self, teacher: str, cfg: JobConfig | None, precision: str, device: str, batch_size: int,
                 workers: int, dtype: str, chunk: int = CHUNK):
        self.world = setup_world(device=device)
        plan = locate_teacher(teacher, "teacher")
        self.teacher = Teacher(plan, self.world.device, Precision(precision, self.world.device).autocast)
        self.identity = teacher_identity(plan.located)
        self.data = teacher_data(cfg.data if cfg is not None else plan.cfg.data, plan.cfg.data)
        self.student = cfg.data if cfg is not None else None
        self.batch_size, self.workers, self.dtype, self.chunk = batch_size, workers, dtype, chunk

    def _open_source(self, spec: str):
        d = self.student or self.data
        return open_indexed(spec, None, d.max_text_length, d.csv, d.cache_dir or None, workers=max(1, self.workers),
                            storage_options=d.storage_options, cache_limit_gb=d.cache_limit_gb,
                            retries=d.remote_retries)

    def _store(self, source) -> TeacherStore:
        t = self.teacher
        bias = None if t.bias is None else float(t.bias)
        meta = StoreMeta(self.identity, source.index_dir.name, len(source), t.model.embed_dim, self.dtype,
                         float(t.scale), bias, self.chunk)
        folder = store_dir(source.index_dir, self.identity)
        if self.world.is_main:
            store = TeacherStore.create(folder, meta)
            if store.missing is None:  # made before missing rows were marked: find them once
                store.mark_missing(source.has_image())
        if self.world.world_size > 1:
            dist.barrier()
        if not self.world.is_main:
            store = TeacherStore.create(folder, meta)  # there now: opened for writing
        return store

    def run(self, spec: str) -> Pass:
        """This rank's chunks not yet written, then the rows of its written chunks stored as missing."""
        started = time.monotonic()
        source = self._open_source(spec)
        store = self._store(source)
        rank, world, chunk = self.world.rank, self.world.world_size, store.meta.chunk
        mine = [c for c in range(store.chunks) if c % world == rank]
        done = [c for c in mine if store.done[c]]
        todo = [c for c in mine if not store.done[c]]
        retry = [int(j) for c in done for j in np.flatnonzero(store.missing[c * chunk:(c + 1) * chunk]) + c * chunk]
        unreadable, embedded, current, parts = 0, 0, None, []
        for rows, batch, samples in self._batches(source, _chunk_batches(todo, len(source), self.batch_size, chunk)):
            embedded += len(rows)
            if current is not None and rows[0] // chunk != current:
                self._write(store, current, parts)
                parts = []
            current = rows[0] // chunk
            unreadable += sum(s.source for s in samples)
            parts.append(self._embed(batch, samples))
        if current is not None:
            self._write(store, current, parts)
        retried = [retry[k:k + self.batch_size] for k in range(0, len(retry), self.batch_size)]
        for rows, batch, samples in self._batches(source, retried):
            still = sum(s.source for s in samples)
            store.put(np.array(rows), *self._embed(batch, samples))
            unreadable, embedded = unreadable + still, embedded + len(rows)
        counts = [len(done), len(todo), embedded, unreadable, len(retry) - int(np.count_nonzero(store.missing[retry]))]
        if world > 1:  # the whole world's counts
            counts = all_reduce_sum(torch.tensor(counts, dtype=torch.int64, device=self.world.device)).tolist()
        return Pass(spec, len(source), store.chunks, *counts, time.monotonic() - started, str(store.folder))

    def _batches(self, source, batches: list[list[int]]):
        """(rows, batch, samples) of each list of row indices, read by the loader's workers."""
        if not batches:
            return []
        tok = self.teacher.tokenizer
        return torch.utils.data.DataLoader(_Rows(source, self.data, tok), batch_sampler=batches,
                                           num_workers=self.workers,
                                           collate_fn=_Collate(Collator.for_data(tok.pad_id, self.data)))

    def _embed(self, batch, samples: list[Sample]) -> tuple[np.ndarray, ...]:
        """(image, text, uid, missing) of a batch's rows; ``missing``: the rows it could not read."""
        enc = self.teacher.encode(batch.to_model_inputs(self.world.device, self.data.mean, self.data.std))
        dtype = np.dtype(self.dtype)
        image, text = (x.float().cpu().numpy().astype(dtype) for x in (enc.image_embeds, enc.text_embeds))
        return (image, text, np.array([s.uid for s in samples], dtype=np.int64),
                np.array([bool(s.source) for s in samples]))

    @staticmethod
    def _write(store: TeacherStore, chunk: int, parts: list) -> None:
        store.write(chunk, *(np.concatenate([p[k] for p in parts]) for k in range(4)))

    def close(self, clean: bool = True) -> None:
        self.world.close(clean)


def teacher_embed(teacher: str, sources: list[str], cfg: JobConfig | None = None, *, precision: str = "fp32",
                  device: str = "auto", batch_size: int = 64, workers: int = 2, dtype: str = DTYPE,
                  chunk: int = CHUNK) -> list[Pass]:
    """Embed every row of each source with ``teacher`` (this rank's share of the chunks); what each pass did."""
    if not sources:
        raise UserError("give the sources to embed (manifests, shard patterns or parquet files)")
    embedder = Embedder(teacher, cfg, precision, device, batch_size, workers, dtype, chunk)
    passes = None
    try:
        passes = [embedder.run(spec) for spec in sources]
        return passes
    finally:
        # after a failure on one rank, the others never reach a closing barrier: no barrier then
        embedder.close(clean=passes is not None)
