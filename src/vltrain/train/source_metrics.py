"""Per-source metrics: how many samples each ``data.train`` source gave and each objective's mean
loss on its rows, between two log lines, exact across ranks (sums and counts are all-reduced, then
divided: not a mean of per-rank means)."""

from __future__ import annotations

import torch

from vltrain.types import RowLosses
from vltrain.runtime.distributed import all_reduce_sum


class SourceMeter:
    """Sums per source: [samples, then per objective: loss sum, rows]. ``read`` on every rank."""

    def __init__(self, names: list[str], objectives: list[str], device: torch.device):
        self.names = names
        self.objectives = objectives
        self.sums = torch.zeros(len(names), 1 + 2 * len(objectives), dtype=torch.float64, device=device)

    def count(self, source: torch.Tensor) -> None:
        self.sums[:, 0].index_add_(0, source, torch.ones_like(source, dtype=self.sums.dtype))

    def add(self, source: torch.Tensor, row_losses: dict[str, RowLosses], applied: torch.Tensor | None = None) -> None:
        """Accumulate on the device, without a host synchronization (no boolean indexing). ``applied``
        (a 0-dim bool on the device): whether the step counts at all (a skipped step's losses do not)."""
        for k, name in enumerate(self.objectives):
            rows = row_losses.get(name)
            if rows is None:
                continue
            applies = rows.applies.to(self.sums.dtype)
            values = rows.values.to(self.sums.dtype) * applies
            if applied is not None:
                # where, not a product: a skipped step's losses may be NaN, and NaN x 0 is NaN
                applies = applies * applied.to(self.sums.dtype)
                values = torch.where(applied, values, 0.0)
            self.sums[:, 1 + 2 * k].index_add_(0, source, values)
            self.sums[:, 2 + 2 * k].index_add_(0, source, applies)

    def read(self) -> dict[str, float]:
        """``source/<name>/samples`` and ``source/<name>/loss/<objective>`` since the last read."""
        sums = all_reduce_sum(self.sums).clone()
        self.sums.zero_()
        out: dict[str, float] = {}
        for s, name in enumerate(self.names):
            out[f"source/{name}/samples"] = float(sums[s, 0])
            for k, objective in enumerate(self.objectives):
                rows = float(sums[s, 2 + 2 * k])
                if rows > 0:
                    out[f"source/{name}/loss/{objective}"] = float(sums[s, 1 + 2 * k]) / rows
        return out
