"""Skipping steps whose loss or gradient norm is not finite, on every rank together.

One rank's NaN must not let the others apply their updates: parameters would drift apart
and DDP would silently average different models from then on. So each step the ranks agree
(one all-reduce, shared with the logged losses) and all skip, or none do.

The verdict stays on the device: the optimizer skips there (:func:`vltrain.train.step.apply_update`)
and the guard counts there, so a step never waits for the device to say whether it was finite.
The counts reach the host at the next log step (:meth:`NonFiniteGuard.settle`), which is where
a run of too many skipped steps stops the run.
"""

from __future__ import annotations

import torch

from vltrain.errors import NonFiniteError


class NonFiniteGuard:
    """Counts skipped steps; ``max_in_a_row`` consecutive ones stop the run. Stateful."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0
        self._pending: torch.Tensor | None = None
        """On the device since the last settle: [skipped in a row now, skipped, longest run]."""

    def record_on_device(self, skipped: torch.Tensor) -> None:
        """Count one step's agreed verdict (a 0-dim bool on the device) without reading it."""
        s = skipped.to(torch.float32)
        if self._pending is None:
            self._pending = torch.tensor([self.in_a_row, 0.0, self.in_a_row], device=s.device)
        run = (self._pending[0] + 1) * s
        self._pending = torch.stack([run, self._pending[1] + s, torch.maximum(self._pending[2], run)])

    def settle(self, step: int) -> int:
        """Read the device counts (one wait, on a log step); returns the steps skipped since the last
        settle, and stops the run if a run of skipped steps reached ``max_in_a_row``."""
        if self._pending is None:
            return 0
        in_a_row, skipped, longest = (int(v) for v in self._pending.tolist())
        self._pending = None
        self.in_a_row, self.total = in_a_row, self.total + skipped
        if self.max_in_a_row and longest >= self.max_in_a_row:
            raise NonFiniteError(
                f"{longest} steps in a row by step {step} had a non-finite loss or gradient "
                f"norm ({self.total} in all). Lower train.lr, raise train.warmup_steps, use bf16 instead "
                "of fp16, or check the data (train.max_nonfinite_steps sets this limit)."
            )
        return skipped

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self._pending = None
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])
