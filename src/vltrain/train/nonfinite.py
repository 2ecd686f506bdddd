"""Skipping steps whose loss or gradient norm is not finite, on every rank together.

One rank's NaN must not let the others apply their updates: parameters would drift apart
and DDP would silently average different models from then on. So each step the ranks agree
(one all-reduce, shared with the logged losses) and all skip, or none do.
"""

from __future__ import annotations

from vltrain.errors import NonFiniteError


class NonFiniteGuard:
    """Counts skipped steps; ``max_in_a_row`` consecutive ones stop the run. Stateful."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0

    def record(self, step: int, finite: bool) -> None:
        """Call with the agreed (all-ranks) verdict of a step, after deciding to skip it or not."""
        if finite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(
                f"{self.in_a_row} steps in a row up to step {step} had a non-finite loss or gradient "
                f"norm ({self.total} in all). Lower train.lr, raise train.warmup_steps, use bf16 instead "
                "of fp16, or check the data (train.max_nonfinite_steps sets this limit)."
            )

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])
