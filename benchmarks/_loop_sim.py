"""The real training loader feeding a step that only sleeps: does the loop ever wait for data?

Used by ``gpu_clip.py --simulate-step-ms``. A loader alone is timed first (what its workers
supply per batch); then the same loader feeds a step that sleeps for a set time, and the loop
measures how much of its wall time it spent in ``next(loader)``. With the step at 80% of the
workers' supply rate (a step of 1.25x the supply time) a loader that never drains waits a few
percent; one that drains at every epoch boundary waits much more when epochs are short.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from vltrain.config.job import load_config
from vltrain.data.dataset import build_dataset
from vltrain.data.loading.loader import build_train_loader
from vltrain.compose.builders import build_tokenizer


def repeat_manifest(data: Path, rows: int, name: str) -> Path:
    """A manifest of ``rows`` rows over the written images, reused under new ids: an epoch of any
    length without writing (or caching) more JPEGs."""
    base = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    path = data / name
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({**base[i % len(base)], "id": f"r{i}"}) + "\n")
    return path


class SleepingDataset:
    """The real dataset's first sample for every row, after a sleep of ``ms`` instead of decoding:
    workers of a fixed, known speed, whatever else the machine runs."""

    uses_random = False

    def __init__(self, dataset, ms: float) -> None:
        self.dataset, self.ms, self.sample = dataset, ms, dataset[0]

    def __len__(self) -> int:
        return len(self.dataset)

    def table(self):
        return self.dataset.table()

    def __getitem__(self, i: int):
        time.sleep(self.ms / 1000)
        return self.sample


SLEEP_MS = [0.0]
"""Per-sample sleep instead of decoding (0: decode the JPEGs); set from ``--sleep-per-sample-ms``."""


def open_loader(overrides: list[str], manifest: Path):
    cfg = load_config(None, [*overrides, f"data.train={manifest}"])
    tokenizer = build_tokenizer(cfg)
    dataset = build_dataset(cfg.data, "train", tokenizer, run_dir=None, plan_aware=True)
    if SLEEP_MS[0] > 0:
        dataset = SleepingDataset(dataset, SLEEP_MS[0])
    return build_train_loader(cfg.data, dataset, rank=0, world_size=1, seed=0, run_dir=None,
                              pad_id=tokenizer.pad_id)


def loader_alone_ms(overrides: list[str], manifest: Path, batches: int, warm: int) -> float:
    """Milliseconds per batch the loader supplies when nothing else runs (after ``warm`` batches)."""
    loader = open_loader(overrides, manifest)
    try:
        for _ in range(warm):
            next(loader)
        start = time.perf_counter()
        for _ in range(batches):
            next(loader)
        return 1000 * (time.perf_counter() - start) / batches
    finally:
        loader.close()


def sleeping_loop(overrides: list[str], manifest: Path, step_ms: float, batches: int, warm: int) -> float:
    """The share of wall time spent waiting for data when each step sleeps ``step_ms``."""
    loader = open_loader(overrides, manifest)
    try:
        for _ in range(warm):
            next(loader)
            time.sleep(step_ms / 1000)
        wait, start = 0.0, time.perf_counter()
        for _ in range(batches):
            t = time.perf_counter()
            next(loader)
            wait += time.perf_counter() - t
            time.sleep(step_ms / 1000)
        return wait / (time.perf_counter() - start)
    finally:
        loader.close()


def simulate(overrides: list[str], data: Path, batch: int, args) -> list[dict]:
    """For 40 and 4 batches per epoch: the loader alone, then the sleeping loop at the given step
    time (``args.simulate_step_ms`` > 0) or at 1.25x the supply time measured at 40 batches."""
    SLEEP_MS[0] = args.sleep_per_sample_ms
    manifests = {e: repeat_manifest(data, e * batch, f"epoch{e}.jsonl") for e in (40, 4)}
    # past the prefetch queue that fills while the loader opens: the supply, not a stored backlog
    warm, n = 2 * args.prefetch * max(1, args.workers), args.steps
    alone = {e: loader_alone_ms(overrides, m, n, warm) for e, m in manifests.items()}
    step_ms = args.simulate_step_ms if args.simulate_step_ms > 0 else 1.25 * alone[40]
    rows = []
    for e, m in manifests.items():
        wait = sleeping_loop(overrides, m, step_ms, n, warm)
        rows.append({"epoch": e, "alone_ms": alone[e], "step_ms": step_ms, "wait": wait})
    return rows
