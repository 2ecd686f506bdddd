"""The map-style dataset over a list of sources: index -> one decoded, tokenized sample.

A sample that cannot be read or decoded, or whose stored teacher embeddings are missing (the
teacher could not read it: :class:`~vltrain.data.teacher_store.MissingRow`), is replaced by another
one chosen by a hash of its index, so every rank and every worker makes the same choice and batch sizes never change. The
failure travels with the replacement into ``Batch.errors``. A source where every sample fails
raises after a bounded number of tries: it never loops.

A training dataset (``plan_aware=True``) also makes a replacement fit the plan the sampler made
from the sample table for the sample it replaces: it has the same modalities and at most as many
tokens (among ``PROBES`` hashed candidates; a longer caption is cut to the planned length and
counted as truncated) and, under a patch budget, at most as many patches when one of them has
that few. So budget batches stay within their token budget. Only a source where
none of the candidates has the planned modality can put an image where none was planned: at most
one image slot more per replaced row.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vltrain.data.config import DataConfig, SourceSpec
from vltrain.data.ids import stable_uid
from vltrain.data.images import ImageError, Seen, image_problem
from vltrain.data.image_input import decode_for, image_layout
from vltrain.data.index.open import open_indexed
from vltrain.data.index.reader import IndexedSource
from vltrain.runtime.cpus import usable_cpus
from vltrain.data.regions import Placed, RegionError, check_inside, parse_regions, place_regions
from vltrain.data.sources.manifests import Row, Source, refuse_malformed
from vltrain.data.table import SampleTable
from vltrain.data.teacher_store import MissingRow, TeacherInputs
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import DataError

log = logging.getLogger(__name__)

MAX_TRIES = 32
"""Failed samples in a row (the sample, then its replacements) before the source is declared
unusable. A source with 50% bad samples gets there with probability 2^-32 per bad sample."""

PROBES = 64
"""Hashed candidates looked at (in the sample table, no decoding) for a replacement that fits."""


@dataclass
class Sample:
    """One decoded sample. ``errors`` lists ``(key, reason)`` of samples it replaces."""

    uid: int
    key: str
    image: torch.Tensor | None  # uint8 [3, S, S]; at its own shape (data.resize native): [patches, 3 * p * p]
    input_ids: list[int]  # with special tokens; empty when the sample has no text
    truncated: bool
    source: int
    errors: list[tuple[str, str]] = field(default_factory=list)
    grid: tuple[int, int] | None = None
    """The image's rows and columns of patches, at its own shape."""
    teacher_image: torch.Tensor | None = None
    """uint8 [3, T, T]: the same decoded image as a distillation teacher that runs takes it; for a
    teacher at native shape, its patches [n, 3 * p * p]."""
    teacher_grid: tuple[int, int] | None = None
    """A teacher at native shape: the rows and columns of its patches of the image."""
    teacher_ids: list[int] = field(default_factory=list)
    """The caption in the teacher's tokenizer (empty without text)."""
    teacher_embeds: tuple | None = None
    """(image, text) float32 [D] arrays (None for a side the row lacks): stored teacher embeddings."""
    regions: Placed | None = None
    """The regions the image keeps, their boxes in [0, 1] of the image as the model sees it, and those
    dropped (cut away by the crop, past ``data.max_regions``); None: the row has none, or no image."""
    region_ids: list[list[int]] = field(default_factory=list)
    """Each kept region's phrase, tokenized as captions are."""
    max_patches: int = 0
    """The patch budget its image was resized within when its step drew one
    (``data.max_patches_choices``), which the collator pads its batch to; 0: ``data.max_patches``."""


class ImageTextDataset(torch.utils.data.Dataset):
    """The concatenation of ``sources``; ``ds[i]`` is a :class:`Sample`."""

    uses_random = False
    """Loading is a pure function of the index (no random augmentation), so the training loader
    need not seed each sample. A subclass that augments must set this to True."""

    def __init__(
        self,
        sources: list[Source],
        tokenizer: Tokenizer,
        cfg: DataConfig,
        weights: list[float] | None = None,
        *,
        plan_aware: bool = False,
        teacher: TeacherInputs | None = None,
    ):
        if not sources:
            raise DataError("no data sources given")
        self.sources = sources
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.max_text_length = cfg.max_text_length
        self.on_error = cfg.on_error
        self.source_names = [s.name for s in sources]
        self.source_weights = list(weights) if weights else [1.0] * len(sources)
        self._starts = np.cumsum([0] + [len(s) for s in sources]).tolist()
        for s in sources:
            if len(s) == 0:
                raise DataError(f"{s.name}: no usable samples" + _problems_hint(s))
        self._table: SampleTable | None = None
        self.plan_aware = plan_aware
        """Replacements fit the sampler's plan (the sample table); off where nothing plans batches."""
        self.teacher = teacher
        """What each sample carries for a distillation teacher (None: no teacher)."""

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict:
        """For loader workers started by pickling: a table still waiting for its token counts or
        patch counts holds a function, and is rebuilt from the mapped indexes in the worker instead."""
        state = dict(self.__dict__)
        if self._table is not None and self._table.pending:
            state["_table"] = None
        return state

    def locate(self, index: int) -> tuple[int, int]:
        """(source index, row within that source) of dataset index ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        s = bisect_right(self._starts, index) - 1
        return s, index - self._starts[s]

    def __getitem__(self, index: int) -> Sample:
        return self.load(index)

    def load(self, index: int, max_patches: int = 0) -> Sample:
        """``ds[index]``, its image resized within ``max_patches`` (its step's drawn budget; 0:
        ``data.max_patches``), a replacement's too."""
        s, j = self.locate(int(index))
        source = self.sources[s]
        planned = int(index)
        errors: list[tuple[str, str]] = []
        failed: set[int] = set()
        for attempt in range(MAX_TRIES):
            row = None
            try:
                row = source.row(j)  # reads the manifest row or the tar span of an indexed source
                sample = self._load(source, s, j, row, errors, max_patches)
                if errors and self.plan_aware:
                    self._fit_plan(sample, planned)
                return sample
            except (ImageError, OSError, MissingRow, RegionError) as e:
                key, where = (row.key, row.where) if row else (f"{source.name}#{j}", f"row {j} of {source.name}")
                reason = _reason(e, row, source)
                if self.on_error == "fail":
                    raise DataError(
                        f"bad sample {key!r} ({where}): {reason}\n"
                        "Set data.on_error: skip to replace bad samples and log them to bad_samples.jsonl."
                    ) from e
                errors.append((key, reason))
                failed.add(j)
            j = self._replacement(s, planned, attempt, failed)
        shown = "; ".join(f"{k}: {r}" for k, r in errors[:3])
        raise DataError(
            f"{source.name}: {MAX_TRIES} samples in a row failed to load ({shown}; ...). The source "
            f"looks unusable: check it with `vltrain data validate {source.name}`."
        )

    def _replacement(self, s: int, planned: int, attempt: int, failed: set[int]) -> int:
        """A row of source ``s`` to load instead: same source, a position spread far from the
        failed one (bad samples come in runs), none of the rows that already ``failed``, with the
        planned modalities and length when the dataset is plan-aware."""
        n = len(self.sources[s])
        candidates = [stable_uid(f"{planned}:{attempt}:{k}") % n for k in range(PROBES)]
        if not self.plan_aware:
            return next((c for c in candidates if c not in failed), candidates[0])
        t = self.table()
        rows = self._starts[s] + np.asarray(candidates)
        same = (t.has_image[rows] == t.has_image[planned]) & (t.has_text[rows] == t.has_text[planned])
        same &= ~np.isin(candidates, list(failed))
        lengths = self._lengths(np.r_[rows, planned])
        fits = same & (lengths[:-1] <= lengths[-1])
        if self.cfg.patch_budget:  # no more patches than planned either
            fits &= t.patches[rows] <= t.patches[planned]
        pick = np.flatnonzero(fits if fits.any() else same)
        return candidates[int(pick[0]) if len(pick) else 0]

    def _fit_plan(self, sample: Sample, planned: int) -> None:
        """Cut a replacement's caption to the planned sample's token count (budget batching)."""
        t = self.table()
        limit = int(self._lengths(np.array([planned]))[0])
        ids = sample.input_ids
        if t.has_text[planned] and len(ids) > limit:
            end = self.tokenizer.eos_id
            # Keep the closing special token, as the tokenizer's own truncation does.
            sample.input_ids = ids[: limit - 1] + ids[-1:] if end is not None and ids[-1] == end and limit > 1 \
                else ids[:limit]
            sample.truncated = True

    def _lengths(self, rows: np.ndarray) -> np.ndarray:
        """Token counts of dataset rows: from the table or the sources' token-count files when at
        hand, else by tokenizing just these rows' captions (a bad sample's candidates: the pass
        over every caption is budget batching's to pay). An unreadable row counts as too long."""
        t = self.table()
        if t.has_lengths:
            return np.asarray(t.text_len[rows], dtype=np.int64)
        held = [s.lengths_at_hand() if isinstance(s, IndexedSource) else None for s in self.sources]
        out = np.empty(len(rows), dtype=np.int64)
        for i, index in enumerate(rows.tolist()):
            s, j = self.locate(index)
            if held[s] is not None:
                out[i] = int(held[s][j])
                continue
            try:
                text = self.sources[s].row(j).text
            except OSError:
                out[i] = 1 << 30
                continue
            out[i] = self.tokenizer.token_lengths([text], self.max_text_length)[0]
        return out

    def _load(self, source: Source, s: int, j: int, row: Row, errors: list, max_patches: int = 0) -> Sample:
        image, grid, data, regions = None, None, None, None
        if row.image is not None:
            data = source.read_image(j)
            image, grid, seen = image_layout(self.cfg, max_patches).decode(data)
            if row.regions is not None and self.cfg.max_regions:
                regions = self._place(row.regions, seen)
        ids, truncated = [], False
        if row.text is not None:
            ids, truncated = self.tokenizer.encode(row.text, self.max_text_length)
        sample = Sample(stable_uid(row.key), row.key, image, ids, truncated, s, errors, grid, regions=regions,
                        max_patches=max_patches)
        if regions is not None:
            phrases = [self.tokenizer.encode(text, self.max_text_length) for text in regions.texts]
            sample.region_ids = [p for p, _ in phrases]
            sample.truncated |= any(cut for _, cut in phrases)
        if self.teacher is not None:
            self._for_teacher(sample, s, j, row, data)
        return sample

    def _place(self, given, seen: Seen) -> Placed:
        """A row's regions checked against its image as shown and mapped to the part the model sees."""
        regions = parse_regions(given)
        check_inside(regions, seen.width, seen.height)
        return place_regions(regions, seen, self.cfg.max_regions)

    def _for_teacher(self, sample: Sample, s: int, j: int, row: Row, data: bytes | None) -> None:
        """The teacher's part of a sample: its stored embeddings of the row, or its own view of the
        same image bytes (decoded at its size, with its resize) and of the caption (its tokenizer)."""
        t = self.teacher
        if t.stores is not None:
            sample.teacher_embeds = t.stores[s].row(j, sample.uid, row.image is not None, row.text is not None,
                                                    f"row {j} of {self.sources[s].name} ({row.where})")
            return
        if data is not None:
            sample.teacher_image, sample.teacher_grid = decode_for(data, t.data)
        if row.text is not None:
            try:
                sample.teacher_ids = t.tokenizer.encode(row.text, t.data.max_text_length)[0]
            except Exception as e:  # the tokenizers library raises a bare Exception (e.g. no unknown token)
                raise DataError(f"row {j} of {self.sources[s].name} ({row.where}): the teacher's tokenizer "
                                f"{t.tokenizer.path} cannot read its caption ({e}); model.teacher needs a "
                                "tokenizer that reads every caption of the data (one with an unknown token)") from None

    def prefetch(self, rows: np.ndarray) -> None:
        """Start fetching what rows about to be loaded need (remote shards), in the background."""
        rows = np.asarray(rows)
        for s, source in enumerate(self.sources):
            mine = rows[(rows >= self._starts[s]) & (rows < self._starts[s + 1])] - self._starts[s]
            if len(mine) and hasattr(source, "prefetch"):
                source.prefetch(mine)

    @property
    def remote(self) -> bool:
        """Whether a source reads in blocks (remote files, parquet row groups): the shuffle is then
        windowed unless data.shuffle_window says otherwise."""
        return any(getattr(s, "cache", None) is not None or getattr(s, "kind", "") == "parquet" for s in self.sources)

    def table(self) -> SampleTable:
        """Modalities and capped token counts of every sample, for samplers (computed once).

        From sample indexes, one source's table is its memory-mapped columns (no copy); several
        sources' are concatenated (6 bytes per sample)."""
        if self._table is None and all(isinstance(s, IndexedSource) for s in self.sources):
            one = len(self.sources) == 1
            join = (lambda parts: parts[0]) if one else np.concatenate
            self._table = SampleTable(
                has_image=join([s.has_image() for s in self.sources]),
                has_text=join([s.has_text() for s in self.sources]),
                text_len=lambda: join([s.text_len() for s in self.sources]),  # on first use
                source=np.broadcast_to(np.int16(0), (len(self),)) if one else np.concatenate(
                    [np.full(len(src), k, dtype=np.int16) for k, src in enumerate(self.sources)]
                ),
                blocks=np.unique(np.concatenate(
                    [start + s.blocks() for start, s in zip(self._starts, self.sources)])),
                patches=self._patch_counts(),
            )
        if self._table is None:
            texts = [t for s in self.sources for t in s.texts()]
            lengths = self.tokenizer.token_lengths(texts, self.max_text_length)
            self._table = SampleTable(
                has_image=np.concatenate([s.has_image() for s in self.sources]),
                has_text=np.fromiter((t is not None for t in texts), dtype=bool, count=len(texts)),
                text_len=np.asarray(lengths, dtype=np.int32),
                source=np.concatenate(
                    [np.full(len(src), k, dtype=np.int16) for k, src in enumerate(self.sources)]
                ),
                patches=self._patch_counts(),
            )
        return self._table

    def _patch_counts(self):
        """The table's patch counts, as a function to call on first use (at their own shape, it reads
        every image's header once, for the first run); None where images are resized to a square."""
        return image_layout(self.cfg).patch_counter(self.sources)


def _reason(e: Exception, row: Row | None, source: Source) -> str:
    """Why a sample could not be used, in words for bad_samples.jsonl and the on_error: fail stop."""
    if isinstance(e, MissingRow):
        return f"no stored teacher embeddings: {e}"
    if isinstance(e, RegionError):
        return f"{e}; `vltrain data validate {source.name}` lists every bad region"
    return image_problem(e, row.image) if row else f"cannot read the row ({e})"


def _problems_hint(source: Source) -> str:
    errors = source.errors()
    if not errors:
        return ""
    return f" ({source.error_count()} malformed row(s) dropped, first: {errors[0]})"


def source_specs(spec: str | list) -> list[SourceSpec]:
    """``data.train`` / ``data.val`` as a list of :class:`SourceSpec`."""
    if isinstance(spec, str):
        return [SourceSpec(path=spec)] if spec else []
    return [s if isinstance(s, SourceSpec) else SourceSpec(**s) for s in spec]


def build_dataset(
    data_cfg: DataConfig, split: str, tokenizer: Tokenizer, run_dir: str | Path | None = None, *,
    plan_aware: bool = False, teacher: TeacherInputs | None = None,
) -> ImageTextDataset:
    """The dataset of ``data.train`` or ``data.val``; ``plan_aware`` for the training loader's.

    With ``on_error: fail`` a malformed manifest row stops here; with ``skip`` it is dropped
    and logged. Shard indexes that cannot sit next to read-only shards go to
    ``data.cache_dir``, else ``RUN_DIR/cache``, else the user cache.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    specs = source_specs(getattr(data_cfg, split))
    if not specs:
        raise DataError(f"data.{split} is empty: give a manifest, a shard pattern, or a list of {{path, weight}}")
    cache_dir = data_cfg.cache_dir or (Path(run_dir) / "cache" if run_dir else None)
    sources = []
    for k, spec in enumerate(specs):
        try:
            source = open_indexed(spec.path, tokenizer, data_cfg.max_text_length, data_cfg.csv, cache_dir,
                                  workers=usable_cpus(), storage_options=data_cfg.storage_options,
                                  cache_limit_gb=data_cfg.cache_limit_gb, retries=data_cfg.remote_retries)
        except DataError as e:
            if len(specs) == 1:
                raise
            raise DataError(f"data.{split}[{k}]: {e}") from None
        if data_cfg.on_error == "fail":
            refuse_malformed(source)
        for d in source.damaged:
            log.warning("%s: %s", d["where"], d["reason"])
        damaged = {d["where"] for d in source.damaged}
        for p in [p for p in source.errors() if p.where not in damaged][:5]:
            log.warning("skipping malformed row %s", p)
        if source.error_count() > 5:
            log.warning("%s: %d malformed rows skipped in all", source.name, source.error_count())
        sources.append(source)
    return ImageTextDataset(sources, tokenizer, data_cfg, [s.weight for s in specs], plan_aware=plan_aware,
                            teacher=teacher)
