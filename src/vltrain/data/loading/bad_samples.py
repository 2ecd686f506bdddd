"""The record of replaced samples: ``RUN_DIR/bad_samples.jsonl``, and the stop past a fraction."""

from __future__ import annotations

import json
import math
from pathlib import Path

from vltrain.data.batch import Batch
from vltrain.errors import DataError

Z = 3.0
"""The bad fraction is judged at the lower end of its Wilson interval at this many standard
deviations (one-sided, about 99.9%): the run stops only once the evidence says the rate is above
the limit, not when an early batch happens to hold two bad files."""
MIN_SEEN = 100
"""Below this many samples tried, only ``ALL_BAD`` stops a run: the interval of a handful is too
wide to say anything (its lower end exceeds 1% at 1 failure in 9)."""
ALL_BAD = 16
"""Every one of the first this many samples failed: the data is unreadable as given (a wrong image
root, a missing mount), and waiting for more evidence would only waste the run's start."""


def rate_lower_bound(bad: int, seen: int, z: float = Z) -> float:
    """The Wilson score interval's lower end for ``bad`` failures in ``seen`` tries."""
    if seen == 0:
        return 0.0
    p = bad / seen
    centre = p + z * z / (2 * seen)
    margin = z * math.sqrt(p * (1 - p) / seen + z * z / (4 * seen * seen))
    return max(0.0, (centre - margin) / (1 + z * z / seen))


class BadSampleLog:
    """Counts every sample tried (delivered + replaced) and every failure.

    A few bad files in a web-scale set are normal; many mean a broken mount or a wrong path
    prefix, and training on the remainder would be silently skewed. So the run stops once the bad
    rate is above ``max_bad_fraction`` with confidence (:func:`rate_lower_bound`, from ``MIN_SEEN``
    samples on), whatever the batch size or the order the samples came in, and at once when the
    first ``ALL_BAD`` all failed. ``max_bad_fraction=0`` stops on the first failure.

    The stop is one decision for the whole run: each rank's loader records what it replaced
    (:meth:`record`), the trainer sums every rank's counts of a step (:meth:`take`, then
    :meth:`add`) and every rank judges those same totals (:meth:`too_many`) after the same step.
    A rank judging its own rows alone would stop while the others wait for it in the next
    collective, and when a run stops would depend on how its rows were split among ranks.
    """

    def __init__(self, run_dir: str | Path | None, max_bad_fraction: float, damaged: list[dict] = (),
                 rows: int = 0, write_damaged: bool = True):
        self.path = Path(run_dir) / "bad_samples.jsonl" if run_dir else None
        self.max_bad_fraction = max_bad_fraction
        self.num_bad = 0
        self.num_seen = 0
        """Over every rank, as of the last step (:meth:`add`): what is judged, and saved."""
        self._new = [0, 0]
        """This rank's failed and tried samples not yet taken into the totals."""
        self.last: tuple[str, str] | None = None
        self.lost = sum(int(d["lost"]) for d in damaged)
        """Samples lost in damaged files (known when the index was built, before any was read)."""
        self.known = self.lost / (rows + self.lost) if self.lost else 0.0
        if self.known > max_bad_fraction:
            first = damaged[0]
            raise DataError(
                f"{self.lost} of {rows + self.lost} samples ({self.known:.2%}) are lost in {len(damaged)} damaged "
                f"file(s), more than data.max_bad_fraction={max_bad_fraction:g}. First: {first['where']}: "
                f"{first['reason']}. Repair them, leave them out of the source, or raise data.max_bad_fraction."
            )
        if damaged and write_damaged and self.path is not None and not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:  # once per run: a resume finds the file
                for d in damaged:
                    f.write(json.dumps({"key": d["where"], "reason": d["reason"], "lost": d["lost"],
                                        "exact": d["exact"]}, ensure_ascii=False) + "\n")

    def too_many(self) -> bool:
        """Whether the samples lost in damaged files and those failing to load are together, with
        confidence, more than ``max_bad_fraction`` of all."""
        if self.num_bad == 0 or self.max_bad_fraction >= 1:
            return False
        if self.num_bad == self.num_seen >= ALL_BAD:
            return True
        if self.num_seen < MIN_SEEN and self.max_bad_fraction > 0:
            return False
        return self._judged() > self.max_bad_fraction

    def _judged(self) -> float:
        return self.known + (1 - self.known) * rate_lower_bound(self.num_bad, self.num_seen)

    def record(self, batch: Batch) -> None:
        """Write this rank's failures down and count them; the stop is judged on the totals."""
        self._new[0] += len(batch.errors)
        self._new[1] += len(batch) + len(batch.errors)
        if batch.errors:
            self.last = batch.errors[-1]
        if batch.errors and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                for key, reason in batch.errors:
                    f.write(json.dumps({"key": key, "reason": reason}, ensure_ascii=False) + "\n")

    def take(self) -> tuple[int, int]:
        """This rank's failed and tried samples since the last take, to be summed over ranks."""
        new, self._new = tuple(self._new), [0, 0]
        return new

    def add(self, bad: int, seen: int) -> None:
        """Count one step's failed and tried samples of every rank into the totals."""
        self.num_bad += bad
        self.num_seen += seen

    def error(self, step: int, last: tuple[str, str] | None) -> DataError:
        """The stop, in words the same on every rank: ``last`` is one failure, whichever rank had it."""
        where = f" (listed in {self.path})" if self.path else ""
        lost = f" and {self.known:.2%} lost in damaged files" if self.lost else ""
        judged = ("every one of them" if self.num_bad == self.num_seen else
                  f"at least {self._judged():.2%} with confidence{lost}")
        example = f" Last: {last[0]}: {last[1]}." if last else ""
        return DataError(
            f"{self.num_bad} of {self.num_seen} samples failed to load by step {step}{where}: {judged}, more "
            f"than data.max_bad_fraction={self.max_bad_fraction:g}.{example} "
            "Check the data with `vltrain data validate`, or raise data.max_bad_fraction."
        )

    def state_dict(self) -> dict:
        """The run's totals: the same on every rank, so the checkpoint's one copy (rank 0's) fits
        every rank of a resumed run, on any world size."""
        return {"num_bad": self.num_bad, "num_seen": self.num_seen}

    def load_state_dict(self, state: dict) -> None:
        self.num_bad = int(state["num_bad"])
        self.num_seen = int(state["num_seen"])
