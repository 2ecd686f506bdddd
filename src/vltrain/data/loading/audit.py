"""The alignment audit: what every rank consumed, and a check that the epochs add up.

With ``data.audit: true`` each rank appends to ``RUN_DIR/audit/rank{R}.jsonl``: one ``epoch``
line when it starts an epoch (the schedule's size, distinct samples, documented drop and
padding) and one ``batch`` line per batch the trainer took (ids, which rows are planned repeats,
and for images at their own shape the batch's sequence length). ``vltrain data audit RUN_DIR``
then checks, per epoch: no sample consumed twice (within a rank or across ranks) except planned
repeats, every rank took the same number of batches, and a complete epoch covered every distinct
sample its schedule held, so that nothing was lost beyond the documented drop. A resumed run
re-records the batches after its checkpoint; the audit keeps the last record of each (epoch, step)
and reports any that changed, which would mean the resume was not exact.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vltrain.errors import UserError


class AuditLog:
    """Appends one rank's consumed ids to ``RUN_DIR/audit/rank{R}.jsonl``."""

    def __init__(self, run_dir: str | Path, rank: int, world_size: int) -> None:
        path = Path(run_dir) / "audit"
        path.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size = rank, world_size
        self._f = open(path / f"rank{rank}.jsonl", "a", buffering=1)

    def _write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row, separators=(",", ":")) + "\n")

    def epoch_header(self, epoch: int, sampler: Any) -> None:
        plan = sampler.plan(epoch)
        self._write({
            "kind": "epoch", "epoch": epoch, "rank": self.rank, "world_size": self.world_size,
            "batches": len(plan), "distinct": plan.distinct, "dropped": plan.dropped, "padded": plan.padded,
            "num_samples": len(sampler.table), "mixed": sampler.source_weights is not None,
        })

    def record(self, epoch: int, step: int, batch: Any, repeats: np.ndarray) -> None:
        """A batch's line; images at their own shape add its sequence length (``patches``: the step's
        patch budget, drawn with ``data.max_patches_choices``)."""
        row = {"kind": "batch", "epoch": epoch, "step": step, "ids": batch.ids.tolist(),
               "repeat": np.flatnonzero(repeats).tolist(), "replaced": len(batch.errors)}
        if batch.images.layout != "square":
            row["patches"] = int(batch.images.pixels.shape[1])
        self._write(row)

    def close(self) -> None:
        """Nothing is left to flush (the file is line-buffered, so a killed run keeps every whole
        line); closing releases the file handle."""
        self._f.close()


@dataclass
class AuditReport:
    epochs: int = 0
    complete_epochs: int = 0
    batches: int = 0
    samples: int = 0
    replaced: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _read(path: Path) -> list[dict]:
    rows = []
    lines = path.read_text().splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            # The last line of a killed run may be cut short; anything else is damage.
            if lineno != len(lines):
                raise UserError(f"{path}:{lineno}: not a JSON line; the audit file is damaged") from None
    return rows


def _load(run_dir: Path, report: AuditReport) -> tuple[dict, dict]:
    """headers[rank][epoch] and batches[rank][epoch][step] -> (ids, repeat, replaced)."""
    files = sorted((run_dir / "audit").glob("rank*.jsonl"))
    if not files:
        raise UserError(f"no audit records under {run_dir}/audit; train with data.audit=true to record them")
    headers: dict = {}
    batches: dict = {}
    for path in files:
        for row in _read(path):
            if row["kind"] == "epoch":
                headers.setdefault(row["rank"], {})[row["epoch"]] = row
                continue
            rank = int(path.stem.removeprefix("rank"))
            steps = batches.setdefault(rank, {}).setdefault(row["epoch"], {})
            rec = (row["ids"], row["repeat"], row.get("replaced", 0))
            old = steps.get(row["step"])
            if old is not None and old[:2] != rec[:2]:
                report.problems.append(
                    f"rank {rank} epoch {row['epoch']} step {row['step']}: the batch recorded after a restart "
                    f"differs from the one before it (resume was not exact)"
                )
            steps[row["step"]] = rec
    return headers, batches


def audit_run(run_dir: str | Path) -> AuditReport:
    run_dir = Path(run_dir)
    report = AuditReport()
    headers, batches = _load(run_dir, report)
    world = {h["world_size"] for per_rank in headers.values() for h in per_rank.values()}
    if len(world) != 1:
        report.problems.append(f"ranks disagree on the world size: {sorted(world)}")
        return report
    world_size = world.pop()
    missing = sorted(set(range(world_size)) - set(batches))
    if missing:
        report.problems.append(f"no batches recorded by rank(s) {missing} of {world_size}")
    epochs = sorted({e for per_rank in batches.values() for e in per_rank})
    for epoch in epochs:
        _check_epoch(epoch, world_size, headers, batches, report)
    return report


def _check_epoch(epoch: int, world_size: int, headers: dict, batches: dict, report: AuditReport) -> None:
    report.epochs += 1
    heads = [headers.get(r, {}).get(epoch) for r in range(world_size)]
    steps = [batches.get(r, {}).get(epoch, {}) for r in range(world_size)]
    planned = {h["batches"] for h in heads if h}
    if len(planned) > 1:
        report.problems.append(f"epoch {epoch}: ranks planned different batch counts {sorted(planned)}")
    first: Counter = Counter()
    repeated: list[int] = []
    replaced = 0
    for rank_steps in steps:
        report.batches += len(rank_steps)
        for ids, repeat, n_replaced in rank_steps.values():
            report.samples += len(ids)
            replaced += n_replaced
            rep = set(repeat)
            for row, uid in enumerate(ids):
                if row in rep:
                    repeated.append(uid)
                else:
                    first[uid] += 1
    report.replaced += replaced
    twice = sum(c - 1 for c in first.values() if c > 1)
    if twice > replaced:
        dup = sorted(u for u, c in first.items() if c > 1)[:5]
        report.problems.append(
            f"epoch {epoch}: {twice} samples consumed more than once outside planned repeats "
            f"(e.g. ids {dup}); {replaced} were bad-sample replacements"
        )
    unknown = [u for u in repeated if u not in first]
    if unknown:
        report.problems.append(f"epoch {epoch}: {len(unknown)} planned repeats of samples never consumed first")
    complete = len(planned) == 1 and all(h for h in heads) and all(
        len(s) == heads[0]["batches"] and set(s) == set(range(len(s))) for s in steps
    )
    if not complete:
        return
    report.complete_epochs += 1
    head = heads[0]
    if len(first) + replaced < head["distinct"]:
        report.problems.append(
            f"epoch {epoch}: {head['distinct'] - len(first)} samples of the schedule were never consumed "
            f"(documented drop: {head['dropped']})"
        )
    if not head["mixed"] and head["distinct"] + head["dropped"] != head["num_samples"]:
        report.problems.append(
            f"epoch {epoch}: the schedule holds {head['distinct']} samples and drops {head['dropped']}, "
            f"but the source has {head['num_samples']}"
        )
