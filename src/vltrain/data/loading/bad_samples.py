"""The record of replaced samples: ``RUN_DIR/bad_samples.jsonl``, and the stop past a fraction."""

from __future__ import annotations

import json
from pathlib import Path

from vltrain.data.batch import Batch
from vltrain.errors import DataError


class BadSampleLog:
    """Counts every sample tried (delivered + replaced) and every failure.

    A few bad files in a web-scale set are normal; many mean a broken mount or a wrong path
    prefix, and training on the remainder would be silently skewed. So the run stops once the
    bad fraction passes ``max_bad_fraction``, but only after ``min_seen`` samples, so that one
    early bad sample does not end a run.
    """

    def __init__(self, run_dir: str | Path | None, max_bad_fraction: float, min_seen: int = 100):
        self.path = Path(run_dir) / "bad_samples.jsonl" if run_dir else None
        self.max_bad_fraction = max_bad_fraction
        self.min_seen = min_seen
        self.num_bad = 0
        self.num_seen = 0
        self.last: tuple[str, str] | None = None

    def record(self, batch: Batch) -> None:
        self.num_bad += len(batch.errors)
        self.num_seen += len(batch) + len(batch.errors)
        if batch.errors:
            self.last = batch.errors[-1]
        if batch.errors and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                for key, reason in batch.errors:
                    f.write(json.dumps({"key": key, "reason": reason}, ensure_ascii=False) + "\n")
        if self.num_seen >= self.min_seen and self.num_bad > self.max_bad_fraction * self.num_seen:
            where = f" (listed in {self.path})" if self.path else ""
            last_key, last_reason = self.last
            raise DataError(
                f"{self.num_bad} of {self.num_seen} samples failed to load{where}, more than "
                f"data.max_bad_fraction={self.max_bad_fraction:g}. Last: {last_key}: {last_reason}. "
                "Check the data with `vltrain data validate`, or raise data.max_bad_fraction."
            )

    def state_dict(self) -> dict:
        return {"num_bad": self.num_bad, "num_seen": self.num_seen}

    def load_state_dict(self, state: dict) -> None:
        self.num_bad = int(state["num_bad"])
        self.num_seen = int(state["num_seen"])
