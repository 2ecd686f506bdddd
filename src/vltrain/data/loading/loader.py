"""Training and evaluation loaders: batches over epochs, an exact data position, the audit trail.

``TrainLoader`` is what the trainer iterates: an endless stream of :class:`Batch` across epochs.
Its position is the number of batches the trainer has *taken* (each ``next()``), not what the
DataLoader workers prefetched, so a checkpoint taken after step k resumes at batch k+1 exactly.

Worker randomness never depends on which worker loads a sample: each sample of a dataset that
draws random numbers is loaded under a seed derived from (seed, epoch, sample index), so any
augmentation is reproduced on resume, whatever ``num_workers``, whether workers persist across
epochs, and which rank or micro-batch the sample falls to. A dataset that says it draws none
(``uses_random = False``) is not seeded at all: seeding costs more than decoding a small image.
"""

from __future__ import annotations

import functools
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from vltrain.data.batch import Batch
from vltrain.data.config import DataConfig, SourceSpec
from vltrain.data.loading.audit import AuditLog
from vltrain.data.loading.bad_samples import BadSampleLog
from vltrain.data.loading.collate import Collator
from vltrain.data.schedule import mixing
from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule
from vltrain.data.table import SampleTable
from vltrain.errors import UserError
from vltrain.runtime.hashing import MASK32, mix32


def _sample_seeds(seed: int, epoch: int, indices: list[int]) -> list[int]:
    """One 32-bit seed per sample, from (seed, epoch, sample index) alone: whichever rank, step,
    micro-batch or worker loads a sample, it is augmented the same, so a global batch split among
    another number of ranks sees the same pixels. (splitmix64's finalizer, vectorized.)"""
    key = np.random.SeedSequence([seed & 0xFFFF_FFFF, epoch]).generate_state(1, np.uint64)
    x = np.asarray(indices, dtype=np.uint64) ^ key
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(32)).tolist()


_PATCH_STREAM = 0x4E61_466C
"""The key word of a step's patch budget, apart from every other keyed draw."""


def step_patches(choices: list[int], seed: int, epoch: int, step: int) -> int:
    """The patch budget of optimizer step ``step`` of ``epoch`` (``data.max_patches_choices``): one of
    ``choices``, from a hash of (seed, epoch, step) alone, so every rank and micro-batch of the step,
    on any split of the global batch and after a resume, computes the same one."""
    h = mix32((seed & MASK32) ^ _PATCH_STREAM)
    for word in ((seed >> 32) & MASK32, epoch & MASK32, step & MASK32):
        h = mix32(h ^ word)
    return choices[h % len(choices)]


def _seed_all(seed: int) -> None:
    # Not torch.manual_seed: it also seeds every accelerator and records a stack trace for
    # lazy device init, far slower (docs/benchmarks/data.md, "Data pipeline"). Workers draw on the CPU
    # generator only.
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@contextmanager
def plain_worker_errors() -> Iterator[None]:
    """Re-raise a UserError from a DataLoader worker with its own message only.

    torch re-raises a worker's exception as the same class, but with "Caught DataError in
    DataLoader worker process 0. Original Traceback ..." in front of the message; a user's
    mistake (a bad sample under on_error: fail) should read as it was written.
    """
    try:
        yield
    except UserError as e:
        text = str(e)
        head = f"\n{type(e).__module__}.{type(e).__qualname__}: "
        if "in DataLoader worker process" not in text or head not in text:
            raise
        raise type(e)(text[text.rindex(head) + len(head):].rstrip("\n")) from None


class _SeededDataset(Dataset):
    """Loads ``dataset[i]`` under a per-sample seed; keys are ``(index, seed, max_patches)``, the
    last the step's drawn patch budget (0: none drawn, ``dataset[i]`` as it is)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.seeded = getattr(dataset, "uses_random", True)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _load(self, index: int, max_patches: int) -> Any:
        return self.dataset.load(index, max_patches) if max_patches else self.dataset[index]

    def __getitem__(self, key: tuple[int, int, int]) -> Any:
        index, seed, max_patches = key
        if not self.seeded:
            return self._load(index, max_patches)
        if get_worker_info() is not None:
            _seed_all(seed)
            return self._load(index, max_patches)
        # In the main process the global generators belong to the trainer (dropout, masking):
        # borrow them and give them back untouched.
        py, npy, pt = random.getstate(), np.random.get_state(), torch.default_generator.get_state()
        _seed_all(seed)
        try:
            return self._load(index, max_patches)
        finally:
            random.setstate(py)
            np.random.set_state(npy)
            torch.default_generator.set_state(pt)


class _SeededBatches:
    """The sampler's batches from its position on, across epochs and without end, each index
    paired with its sample seed and its step's patch budget.

    One DataLoader iterator therefore serves the whole run: its workers prefetch the next
    epoch's first batches while the trainer takes the current epoch's last, instead of
    draining at every boundary.

    With ``choices`` (``data.max_patches_choices``) each optimizer step draws its patch budget
    (:func:`step_patches`), keyed by the step's place in the epoch: the sampler's batch ``k`` is
    micro-batch ``k % micro`` of step ``k // micro``, ``micro`` being the micro-batches a rank takes
    per step. An epoch is a whole number of steps there (the sampler pads it to whole global
    batches; without a global batch a step is one micro-batch, as
    ``vltrain.compose.rules.resolve_global_batch`` requires), so any split of one global batch puts
    the same rows in the same step and draws the same budget.
    """

    def __init__(self, sampler: DistributedBatchSampler, choices: list[int] = ()) -> None:
        self.sampler, self.choices = sampler, list(choices)
        self.micro = sampler.global_batch // (sampler.world_size * sampler.batch_size) if sampler.global_batch else 1

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        s = self.sampler
        for epoch, k, batch in s.endless():
            most = step_patches(self.choices, s.seed, epoch, k // self.micro) if self.choices else 0
            yield [(i, seed, most) for i, seed in zip(batch, _sample_seeds(s.seed, epoch, batch))]


def _own_process_group(worker_id: int = 0) -> None:
    """A loader worker leaves its trainer's process group.

    torchrun stops a worker by signalling its whole process group (and a shell, Ctrl-C): on a
    preemption's SIGTERM the loader workers would die at once, and the trainer's next batch would
    fail before the checkpoint the signal asks for. In a group of their own they keep serving
    until the loader shuts them down; they still end with the trainer (torch's watchdog in the
    worker loop) and with multiprocessing's own clean-up at exit.
    """
    os.setpgid(0, 0)


def _worker_init(seed: int, rank: int, worker_id: int) -> None:
    """Seeds a worker's generators at start (loading reseeds per sample; this covers the rest)."""
    _own_process_group()
    _seed_all(int(np.random.SeedSequence([seed & 0xFFFF_FFFF, rank, worker_id], spawn_key=(1,)).generate_state(1)[0]))


class TrainLoader:
    """Endless iterator of batches across epochs; ``state_dict`` is the trainer's data position."""

    def __init__(
        self,
        dataset: Dataset,
        sampler: DistributedBatchSampler,
        *,
        collate: Callable[[list], Batch],
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
        persistent_workers: bool = False,
        bad_log: BadSampleLog | None = None,
        audit: AuditLog | None = None,
        max_patches_choices: list[int] = (),
    ) -> None:
        """``max_patches_choices``: each step's patch budget is drawn from these (``_SeededBatches``)."""
        self.sampler = sampler
        self.bad_log, self.audit = bad_log, audit
        self.elastic = False
        """Set by the trainer when the run is set by its global batch: a resume may then split the
        same global batch among another number of ranks and micro-batches."""
        self.teacher = None
        """The distillation teacher's part of each batch (``TeacherInputs``), when the dataset makes one."""
        self.samples_seen = 0
        extra = {}
        if num_workers > 0:
            # The batches never end (one iterator for the whole run), so workers persist anyway;
            # ``persistent_workers`` only keeps them over a resume's repositioning.
            extra = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         worker_init_fn=functools.partial(_worker_init, sampler.seed, sampler.rank))
        # DataLoader draws its workers' base seed from this generator; left to the global one,
        # every new epoch would shift the trainer's random stream.
        generator = torch.Generator().manual_seed(
            int(np.random.SeedSequence([sampler.seed & 0xFFFF_FFFF, sampler.rank]).generate_state(1)[0]))
        batches = _SeededBatches(sampler, max_patches_choices)
        self._loader = DataLoader(
            _SeededDataset(dataset), batch_sampler=batches, num_workers=num_workers,
            pin_memory=pin_memory and torch.cuda.is_available(), collate_fn=collate, generator=generator,
            **extra,
        )
        self._it: Iterator[Batch] | None = None

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def step_in_epoch(self) -> int:
        """Batches of the current epoch the trainer has taken."""
        return self.sampler.consumed

    def __len__(self) -> int:
        """Batches in the current epoch."""
        return len(self.sampler)

    def __iter__(self) -> "TrainLoader":
        return self

    def __next__(self) -> Batch:
        if self.sampler.exhausted():
            self.sampler.set_epoch(self.sampler.epoch + 1)
        if self.audit is not None and self.sampler.consumed == 0:
            self.audit.epoch_header(self.sampler.epoch, self.sampler)
        if self._it is None:
            self._it = iter(self._loader)
        with plain_worker_errors():
            batch = next(self._it)
        epoch, step = self.sampler.epoch, self.sampler.consumed
        self.sampler.mark_consumed()
        self.samples_seen += len(batch)
        if self.audit is not None:
            self.audit.record(epoch, step, batch, self.sampler.plan().repeats[step])
        if self.bad_log is not None:
            self.bad_log.record(batch)
        return batch

    def close(self) -> None:
        """Stop the worker processes now, through the loader's own shutdown; close the audit file."""
        it = getattr(self._loader, "_iterator", None)
        it = self._it if it is None else it  # not ``or``: an endless iterator has no length to be truthy by
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        self._it = None
        if self.audit is not None:
            self.audit.close()

    def state_dict(self) -> dict:
        state = {"sampler": self.sampler.state_dict(), "samples_seen": self.samples_seen}
        if self.bad_log is not None:
            state["bad_samples"] = self.bad_log.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Position the loader; the next ``next()`` returns the first batch the saved run never took.

        A checkpoint of another world size resumes in the same epoch with the same number of the
        epoch's samples consumed, rounded down to a whole step of this world. An epoch's sample
        order does not depend on the world size, so the run continues where it was by samples
        seen; batches are composed differently, so that resume is not bit-exact.
        """
        sampler, world, batch = state["sampler"], self.sampler.world_size, self.sampler.batch_size
        saved_world, saved_batch = sampler["world_size"], sampler.get("batch_size", batch)
        saved_global = sampler.get("global_batch", self.sampler.global_batch)
        if self.elastic and saved_global != self.sampler.global_batch:
            raise UserError(f"cannot resume the same run: the checkpoint's global batch is {saved_global} samples, "
                            f"this run's is {self.sampler.global_batch} (data.global_batch_size); resume with "
                            f"data.global_batch_size={saved_global}")
        if self.elastic and (saved_world, saved_batch) != (world, batch):
            # the same global batch split another way (the trainer checks it): the position in samples
            rows = sampler["consumed"] * saved_world * saved_batch
            sampler = {**sampler, "world_size": world, "batch_size": batch, "consumed": rows // (world * batch)}
        elif saved_world != world:
            sampler = {**sampler, "world_size": world, "consumed": sampler["consumed"] * saved_world // world}
        self.sampler.load_state_dict(sampler)
        self.samples_seen = int(state["samples_seen"])
        if self.bad_log is not None and "bad_samples" in state:
            self.bad_log.load_state_dict(state["bad_samples"])
        self._it = None


def source_shares(sources: str | list[SourceSpec], table: SampleTable) -> list[float] | None:
    """Each source's share of an epoch, from the config's per-source weights.

    A config weight is a sampling rate per row, relative to the other sources (OpenCLIP's
    upsampling factor): a source's share is ``weight x rows``. Equal weights therefore read every
    row once per epoch, and ``weight: 3`` reads a source's rows three times as often. A single
    source needs no draw (None: every row once per epoch).
    """
    if isinstance(sources, str) or len(sources) < 2:
        return None
    bounds, ids = mixing.source_runs(table.source)  # no per-row array: the column may be a billion rows
    rows = np.bincount(ids, weights=np.diff(bounds), minlength=len(sources)).astype(np.int64)
    return [float(s.weight) * int(n) for s, n in zip(sources, rows)]


REMOTE_WINDOW = 16
"""Blocks per window of the shuffle for remote training data, unless data.shuffle_window says."""


def shuffle_window(data_cfg: DataConfig, dataset: Any) -> int:
    """``data.shuffle_window``, with -1 resolved: a full permutation for local data; for remote
    shards the windowed shuffle, since a random shard per sample would download every shard for
    every batch."""
    if data_cfg.shuffle_window >= 0:
        return data_cfg.shuffle_window
    return REMOTE_WINDOW if getattr(dataset, "remote", False) else 0


def build_train_loader(
    data_cfg: DataConfig,
    dataset: Any,
    *,
    rank: int,
    world_size: int,
    seed: int,
    run_dir: str | None,
    pad_id: int,
) -> TrainLoader:
    """The trainer's loader: ``dataset`` must offer ``table() -> SampleTable`` and ``ds[i]``.

    The sampler and the collator take the padding multiple from one ``data_cfg.resolve()``: the
    budget packer plans each batch's width the way the collator pads it.
    """
    table = dataset.table()
    resolved = data_cfg.resolve()
    schedule = Schedule(
        batch_size=data_cfg.batch_size, seed=seed, shuffle=data_cfg.shuffle, remainder=data_cfg.remainder,
        batching=data_cfg.batching, token_budget=resolved.token_budget, image_budget=resolved.image_budget,
        patch_budget=resolved.patch_budget,
        source_weights=source_shares(data_cfg.train, table), epoch_size=data_cfg.epoch_size or None,
        pad_multiple=resolved.pad_multiple, window=shuffle_window(data_cfg, dataset),
        global_batch=data_cfg.global_batch_size,
    )
    sampler = DistributedBatchSampler(table, schedule, rank=rank, world_size=world_size)
    if getattr(dataset, "remote", False):
        sampler.lookahead = dataset.prefetch
    collate = Collator.for_data(pad_id, data_cfg, resolved.pad_multiple, getattr(dataset, "teacher", None))
    # Without a run folder bad samples are still counted and capped, just not written down.
    damaged = [d for s in getattr(dataset, "sources", []) for d in getattr(s, "damaged", [])]
    bad_log = BadSampleLog(run_dir, data_cfg.max_bad_fraction, damaged, len(dataset), write_damaged=rank == 0)
    audit = AuditLog(run_dir, rank, world_size) if run_dir is not None and data_cfg.audit else None
    return TrainLoader(
        dataset, sampler, collate=collate, num_workers=data_cfg.num_workers, pin_memory=data_cfg.pin_memory,
        prefetch_factor=data_cfg.prefetch_factor, persistent_workers=data_cfg.persistent_workers,
        bad_log=bad_log, audit=audit, max_patches_choices=data_cfg.max_patches_choices,
    )


# ---------------------------------------------------------------------------------------------
# Evaluation


class _Slice:
    """Sequential batches over ``[start, start + count)``, stretched to ``steps`` batches.

    Batches past the slice's end hold one padding row, a repeat of the slice's last row (row 0
    of the dataset for an empty slice), so padding rows always come last.
    """

    def __init__(self, start: int, count: int, batch_size: int, steps: int) -> None:
        self.start, self.count, self.batch_size, self.steps = start, count, batch_size, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        pad = self.start + self.count - 1 if self.count else 0
        for s in range(self.steps):
            lo, hi = s * self.batch_size, min((s + 1) * self.batch_size, self.count)
            yield list(range(self.start + lo, self.start + hi)) if hi > lo else [pad]


@dataclass
class EvalLoader:
    """Sequential evaluation batches of one rank.

    Each rank reads a contiguous slice of the dataset, ``[offset, offset + num_samples)``, and
    every rank runs the same number of batches, so an evaluator that gathers embeddings never
    waits on a rank that finished early. To get there, the last batches of short slices are
    padded with one repeated row each: **keep only the first ``num_samples`` rows** of what this
    rank produces (padding rows are always at the end).
    """

    loader: DataLoader
    offset: int
    num_samples: int

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        with plain_worker_errors():
            yield from self.loader


def build_eval_loader(
    data_cfg: DataConfig,
    dataset: Any,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    pad_id: int,
    rows: int = 0,
) -> EvalLoader:
    """Evaluation batches are fixed and sequential, so their text pads as fixed batches do by
    default: to a multiple of 8 (the ``Collator``'s own default). ``rows``: only the first ones."""
    n = min(len(dataset), rows) if rows else len(dataset)
    start, stop = rank * n // world_size, (rank + 1) * n // world_size
    longest = -(-n // world_size)
    steps = max(1, -(-longest // batch_size))
    batches = _Slice(start, stop - start, batch_size, steps)
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=data_cfg.num_workers,
                        worker_init_fn=_own_process_group if data_cfg.num_workers else None,
                        pin_memory=data_cfg.pin_memory and torch.cuda.is_available(),
                        collate_fn=Collator.for_data(pad_id, data_cfg))
    return EvalLoader(loader, start, stop - start)
