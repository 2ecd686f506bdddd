"""The distributed batch sampler: the same schedule on every rank, a disjoint slice for each.

Every rank computes the *whole* epoch schedule (all ranks' batches, step by step) from the
sample table, the seed and the epoch, with no communication, and keeps its own column of it.
So step counts match by construction, which is what keeps collectives from hanging, and a rank
can never draw a sample that another rank draws in the same epoch (except documented repeats).

Fixed batching: the epoch order is cut into ``world_size x batch_size`` steps. ``remainder``
says what happens to a last incomplete step: ``pad`` fills it by repeating the epoch's first
samples, ``drop`` leaves those samples out of this epoch (they come back in the next shuffle).

Budget batching: batches are packed under the token and image budgets (see
:mod:`vltrain.data.schedule.budget`), so batch sizes vary and, within one step, ranks usually get batches
of different sizes. That is deliberate: the contrastive losses gather variable-size batches
exactly, and forcing equal sizes would waste the budget. Step counts are equalized by splitting
the largest batches until the count divides by the world size; ``remainder`` only applies when
too few rows are left to split (tiny epochs). With a global batch (``Schedule.global_batch``) whole
steps are packed for the world under step budgets instead, and each is cut into its micro-batches
(``budget.pack_steps``): the same steps whatever the number of ranks.

The sampler never counts what it yields: a DataLoader iterates it ahead of the trainer. The
loader reports consumed batches with :meth:`mark_consumed`, and :meth:`state_dict` holds that
count, so a restore resumes at the first batch the trainer never saw.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterator, Literal

import numpy as np

from vltrain.data.schedule import budget, mixing
from vltrain.data.schedule.window import LazyBatches, LazyBudgetBatches, LazyRepeats, WindowedOrder, Windows
from vltrain.data.table import SampleTable, default_blocks
from vltrain.errors import UserError

log = logging.getLogger(__name__)

_TAG_BATCHES = 2
LOOKAHEAD = 16
"""Batches ahead of the loader that remote shards are fetched for."""


@dataclass
class EpochPlan:
    """One rank's batches for one epoch, and what the epoch left out or repeated (for the audit)."""

    batches: list[np.ndarray] | LazyBatches
    """This rank's batches of dataset indices, in step order (computed one by one when lazy)."""
    repeats: list[np.ndarray] | LazyRepeats
    """Per batch, bool per row: the sample already occurs earlier in the epoch (on any rank)."""
    distinct: int
    """Distinct samples the epoch's schedule holds over all ranks."""
    dropped: int
    """Samples drawn for the epoch that were left out to equalize step counts."""
    padded: int
    """Rows added by repetition to equalize step counts."""

    def __len__(self) -> int:
        return len(self.batches)


def _first_occurrence(steps: list[np.ndarray]) -> list[np.ndarray]:
    """Per batch, a mask of rows whose sample appears in an earlier row of the epoch."""
    flat = np.concatenate(steps) if steps else np.empty(0, dtype=np.int64)
    _, first = np.unique(flat, return_index=True)
    repeat = np.ones(len(flat), dtype=bool)
    repeat[first] = False
    return np.split(repeat, np.cumsum([len(b) for b in steps])[:-1]) if steps else []


def _has(batches, k: int) -> bool:
    return batches.has(k) if hasattr(batches, "has") else 0 <= k < len(batches)


class LazyPlan:
    """An :class:`EpochPlan` of :class:`LazyBatches`. A mixture's epoch can meet a sample twice
    (where a source's quota runs into its next pass), so ``distinct`` is counted when asked (the
    audit's epoch line), walking the windows where that can happen."""

    def __init__(self, batches: LazyBatches, dropped: int, padded: int):
        self.batches, self.repeats, self.dropped, self.padded = batches, LazyRepeats(batches), dropped, padded

    def __len__(self) -> int:
        return len(self.batches)

    @cached_property
    def distinct(self) -> int:
        kept = len(self.batches.order) - self.dropped
        return kept - self.batches.order.repeat_count(kept)


class LazyBudgetPlan:
    """An :class:`EpochPlan` of :class:`LazyBudgetBatches`: what the epoch drops, pads or repeats is
    known once every window is packed, so asking for it (the audit's epoch line) packs them."""

    def __init__(self, batches: LazyBudgetBatches, num_samples: int):
        self.batches, self.repeats, self.num_samples = batches, LazyRepeats(batches), num_samples

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def dropped(self) -> int:
        len(self.batches)
        return self.batches.dropped

    @property
    def padded(self) -> int:
        len(self.batches)
        return self.batches.padded

    @property
    def distinct(self) -> int:
        return self.num_samples - self.dropped - self.batches.repeated


@dataclass(frozen=True)
class Schedule:
    """How an epoch is cut into steps, the same on every rank: what the sampler is given besides
    the table and the rank. The loader fills it from ``DataConfig`` and its ``resolve()``."""

    batch_size: int = 0
    """Rows per rank per step (fixed batching; budget batching's count cap)."""
    seed: int = 0
    shuffle: bool = True
    remainder: Literal["pad", "drop"] = "pad"
    batching: Literal["fixed", "budget"] = "fixed"
    token_budget: int = 0
    image_budget: int = 0
    patch_budget: int = 0
    """Budget batching at native image shape: the most patches per batch (per step with a global batch);
    0: none. The table's ``patches`` are then read."""
    source_weights: list[float] | None = None
    """Per-source sampling weights of a mixture; None: every row once per epoch."""
    epoch_size: int | None = None
    pad_multiple: int = budget.PAD_MULTIPLE
    window: int = 0
    """Blocks per window of the windowed shuffle (vltrain.data.schedule.window); 0: a full permutation."""
    global_batch: int = 0
    """data.global_batch_size (0: not set). Budget batching then packs whole steps for the world, under
    step budgets, and deals each to its ``global_batch // batch_size`` micro-batches."""


class DistributedBatchSampler:
    """Yields this rank's batches (lists of dataset indices) of the current epoch."""

    def __init__(self, table: SampleTable, schedule: Schedule, *, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        if len(table) == 0:
            raise UserError("the training data holds no samples")
        if schedule.source_weights is not None:
            mixing.check_weights(table.source, schedule.source_weights)
        self.table, self.schedule = table, schedule
        self.rank, self.world_size = rank, world_size
        s = schedule
        self.batch_size, self.seed, self.shuffle, self.remainder = s.batch_size, s.seed, s.shuffle, s.remainder
        self.batching, self.source_weights, self.epoch_size = s.batching, s.source_weights, s.epoch_size
        # Budget batching packs under these as given: DataConfig.resolve() decides them.
        self.pad_multiple, self.token_budget, self.image_budget = s.pad_multiple, s.token_budget, s.image_budget
        self.patch_budget = s.patch_budget if s.batching == "budget" else 0
        self._patches_total: int | None = None
        self.window = int(s.window)
        self.global_batch = s.global_batch
        self.lookahead: Callable[[np.ndarray], None] | None = None
        """Called with the batch ``LOOKAHEAD`` steps ahead of each one yielded (remote data
        starts downloading its shards)."""
        self.epoch = 0
        self.consumed = 0
        """Batches of the current epoch the trainer has consumed; iteration resumes after them."""
        self._plans: dict[int, EpochPlan] = {}
        self._mixture: mixing.Mixture | None = None

    # -- the schedule ----------------------------------------------------------------------

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """This rank's schedule for ``epoch`` (default: the current one).

        Two epochs are cached (the last asked for and its nearest): across an epoch boundary the loader's workers
        already read the next epoch while the trainer still takes the current one's batches.
        """
        e = self.epoch if epoch is None else epoch
        if e not in self._plans:
            if len(self._plans) >= 2:
                del self._plans[max(self._plans, key=lambda k: abs(k - e))]
            self._plans[e] = self._compute(e)
        return self._plans[e]

    def _windowed(self, epoch: int) -> Windows:
        """The epoch's order under the windowed shuffle; with source weights, the mixture's."""
        if self.source_weights is None:
            blocks = self.table.blocks if self.table.blocks is not None else default_blocks(len(self.table))
            return WindowedOrder(blocks, seed=self.seed, epoch=epoch, window=self.window, shuffle=self.shuffle)
        if self._mixture is None:
            self._mixture = mixing.Mixture(self.table.source, self.table.blocks, self.source_weights,
                                           self.epoch_size, seed=self.seed, window=self.window, shuffle=self.shuffle)
        return self._mixture.order(epoch)

    def _lazy_plan(self, epoch: int) -> LazyPlan:
        """Fixed batches of the windowed order, each computed when the loader asks for it."""
        order = self._windowed(epoch)
        n, step, unit = len(order), self.world_size * self.batch_size, self._unit()
        whole = n // unit if self.remainder == "drop" else -(-n // unit)
        if whole == 0:
            raise UserError(
                f"data.remainder=drop leaves no batch: {n} samples per epoch for {self.world_size} ranks "
                f"x batch_size {self.batch_size}; use data.remainder=pad or a smaller batch"
            )
        steps = whole * unit // step
        dropped, padded = max(0, n - whole * unit), max(0, whole * unit - n)
        batches = LazyBatches(order, rank=self.rank, world_size=self.world_size, batch_size=self.batch_size,
                              steps=steps)
        return LazyPlan(batches, dropped, padded)

    def _lazy_budget_plan(self, epoch: int) -> LazyBudgetPlan:
        """Budget batches packed window by window as the loader reaches them."""
        def pack(rows: np.ndarray, w: int) -> list[np.ndarray]:
            return self._pack(rows, mixing.rng_for(self.seed, _TAG_BATCHES, epoch, w + 1) if self.shuffle else None)

        order = self._windowed(epoch)
        batches = LazyBudgetBatches(order, pack, rank=self.rank, world_size=self.world_size,
                                    remainder=self.remainder)
        return LazyBudgetPlan(batches, len(order))

    def _pack(self, rows: np.ndarray, rng: np.random.Generator | None) -> list[np.ndarray]:
        """Budget batches of ``rows``, a multiple of the world size of them, in dealing order: per
        rank (split until the count divides), or with a global batch per step (whole steps for the
        world, each cut into its micro-batches: ``budget.pack_steps``)."""
        if self.global_batch:
            return budget.pack_steps(rows, self.table, global_batch=self.global_batch,
                                     slots=self.global_batch // self.batch_size, token_budget=self.token_budget,
                                     image_budget=self.image_budget, rng=rng, pad_multiple=self.pad_multiple,
                                     patch_budget=self.patch_budget)
        batches = budget.pack(rows, self.table, batch_size=self.batch_size, token_budget=self.token_budget,
                              image_budget=self.image_budget, rng=rng, pad_multiple=self.pad_multiple,
                              patch_budget=self.patch_budget)
        return budget.split_to_multiple(batches, self.world_size)

    def _compute(self, epoch: int) -> EpochPlan:
        if self.window:
            return self._lazy_plan(epoch) if self.batching == "fixed" else self._lazy_budget_plan(epoch)
        order = mixing.epoch_order(
            self.table.source, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
            weights=self.source_weights, epoch_size=self.epoch_size,
        )
        if self.batching == "budget":
            batches = self._pack(order, mixing.rng_for(self.seed, _TAG_BATCHES, epoch) if self.shuffle else None)
        else:
            batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        steps, dropped, padded = self._equalize(batches, order)
        if self.rank == 0 and (dropped or padded):
            # the same every epoch: said once, then at debug level (data.audit records every epoch)
            level = logging.DEBUG if getattr(self, "_remainder_said", False) else logging.INFO
            self._remainder_said = True
            log.log(level, "epoch %d: %d steps; remainder=%s: %d samples dropped, %d rows padded by repetition",
                    epoch, sum(len(b) for b in steps) // self._unit() if self.batching == "fixed"
                    else len(steps) // self.world_size, self.remainder, dropped, padded)
        repeats = _first_occurrence(steps)
        distinct = sum(int((~r).sum()) for r in repeats)  # each sample's first occurrence, counted once
        mine = slice(self.rank, None, self.world_size)
        return EpochPlan(steps[mine], repeats[mine], distinct, dropped, padded)

    def _unit(self) -> int:
        """What an epoch of fixed batches is padded or cut to a multiple of: a global batch (so an
        optimizer step never spans two epochs, and the epoch's end falls at the same step on any
        split), or else one step of every rank's batch."""
        return self.global_batch or self.world_size * self.batch_size

    def _equalize(self, batches: list[np.ndarray], order: np.ndarray) -> tuple[list[np.ndarray], int, int]:
        """Make the batch count a multiple of the world (and fixed batches full): pad or drop."""
        w, b, unit = self.world_size, self.batch_size, self._unit()
        full = self.batching == "fixed" and len(order) % unit == 0
        if len(batches) % w == 0 and (self.batching == "budget" or full):
            return batches, 0, 0
        if self.remainder == "drop":
            keep = (len(order) // unit) * unit // b if self.batching == "fixed" else (len(batches) // w) * w
            if keep == 0:
                raise UserError(
                    f"data.remainder=drop leaves no batch: {len(order)} samples per epoch for {w} ranks "
                    f"x batch_size {b}; use data.remainder=pad or a smaller batch"
                )
            dropped = sum(len(x) for x in batches[keep:])
            return batches[:keep], dropped, 0
        if self.batching == "fixed":
            steps = -(-len(order) // unit)
            need = steps * unit - len(order)
            filled = np.concatenate([order, np.resize(order, need)])
            return [filled[i : i + b] for i in range(0, len(filled), b)], 0, need
        extra = -len(batches) % w
        pads = [batches[i % len(batches)] for i in range(extra)]
        return batches + pads, 0, sum(len(x) for x in pads)

    # -- the sampler protocol ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.plan())

    def __iter__(self) -> Iterator[list[int]]:
        for _, _, batch in self._walk(self.epoch, self.consumed, endless=False):
            yield batch

    def endless(self) -> Iterator[tuple[int, int, list[int]]]:
        """``(epoch, step, batch)`` from the current position on, across epoch boundaries, forever.

        Reading ahead does not move the position (``epoch``, ``consumed``): the trainer moves it
        as it takes batches, in the same order.
        """
        return self._walk(self.epoch, self.consumed, endless=True)

    def _walk(self, epoch: int, k: int, *, endless: bool) -> Iterator[tuple[int, int, list[int]]]:
        while True:
            plan = self.plan(epoch)
            while _has(plan.batches, k):
                if self.lookahead is not None and _has(plan.batches, k + LOOKAHEAD):
                    self.lookahead(plan.batches[k + LOOKAHEAD])
                yield epoch, k, plan.batches[k].tolist()
                k += 1
            if not endless:
                return
            epoch, k = epoch + 1, 0

    def exhausted(self) -> bool:
        """The trainer has taken every batch of the current epoch (a lazy plan packs no further)."""
        return not _has(self.plan().batches, self.consumed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = int(epoch), 0

    def mark_consumed(self, batches: int = 1) -> None:
        self.consumed += batches

    def _identity(self) -> dict:
        """What the schedule depends on besides the position: a resume must match all of it."""
        identity = {"seed": self.seed, "world_size": self.world_size, "batching": self.batching,
                    "batch_size": self.batch_size, "num_samples": len(self.table), "pad_multiple": self.pad_multiple,
                    "shuffle_window": self.window, "source_weights": self.source_weights, "epoch_size": self.epoch_size}
        if self.global_batch:
            identity["global_batch"] = self.global_batch
        if self.global_batch and self.batching == "budget":  # the step budgets decide the steps
            identity.update(token_budget=self.token_budget, image_budget=self.image_budget)
        if self.patch_budget:  # so do the patch budget and every image's patch count
            if self._patches_total is None:  # a sum over every row: once, not at every checkpoint
                self._patches_total = int(self.table.patches.sum())
            identity.update(patch_budget=self.patch_budget, patches=self._patches_total)
        return identity

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position; refuses a schedule that would differ from the saved one."""
        for key, mine in self._identity().items():
            if key in state and state[key] != mine:
                raise UserError(
                    f"cannot resume the data position exactly: the checkpoint's sampler has {key}={state[key]}, "
                    f"this run has {key}={mine}; resume with the same data, batch size, seed and world size"
                )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
