"""No training step waits for the device, except on log steps.

``HostSyncCounter`` sees every operation that makes the host wait (``.item()``, ``bool(t)``,
``nonzero``, a boolean-mask index, a copy to the host). On a CPU nothing waits, but the same
operations run, so counting them here proves the step free of them on a GPU. The text tower
runs padded, as ``model.text.layout=auto`` does on a GPU (packing it finds the tokens with
``nonzero``, on a CPU only, where that costs nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kits.multiproc import run_world
from kits.spmd_fixtures import config, make_mixed_shapes

from vltrain.runtime.host_sync import HostSyncCounter

STEPS = 4
LOG_EVERY = 3
CASES = {
    "clip": ["model.preset=tiny-clip"],
    "fusion": ["model.preset=tiny-albef"],
    "clip-gradcache": ["model.preset=tiny-clip", "train.contrastive_accumulation=gradcache",
                       "train.accumulation=2"],
}


def count_per_step(root: Path, run_dir: Path, overrides: list[str]) -> list[int]:
    """Syncs in each of ``STEPS`` steps of the trainer's own loop (step ``LOG_EVERY`` logs)."""
    from vltrain.train.trainer import Trainer

    cfg = config(root, run_dir, [*overrides, f"train.max_steps={STEPS + 1}", f"train.log_every={LOG_EVERY}",
                                 "train.debug_spmd=false", "model.text.layout=padded"])
    trainer = Trainer(cfg)
    counts: list[int] = []
    step = trainer.train_step

    def counted(micro):
        with HostSyncCounter() as c:
            out = step(micro)
            if trainer.step + 1 == LOG_EVERY:  # the loop's log runs after the step: count it with it
                trainer.settle()
        counts.append(c.total)
        if len(counts) == STEPS:
            object.__setattr__(trainer.cfg.train, "max_steps", trainer.step + 1)  # past the frozen config
        return out

    trainer.train_step = counted
    try:
        trainer.train()
    finally:  # not trainer.close(): a test rank's process group outlives its trainer
        trainer.metrics.close()
        trainer.loader.close()
    return counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_that_does_not_log_never_waits_for_the_device(tmp_path, case):
    root = make_mixed_shapes(tmp_path / "shapes")  # text-only, image-only and paired rows mixed
    counts = count_per_step(root, tmp_path / "run", CASES[case])
    assert counts[LOG_EVERY - 1] > 0  # the counter sees the log step's reads
    assert [c for i, c in enumerate(counts) if i != LOG_EVERY - 1] == [0] * (STEPS - 1)


def _two_ranks(rank: int, world: int, root: str, run_dir: str, case: str) -> list[int]:
    return count_per_step(Path(root), Path(run_dir), CASES[case])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["clip", "fusion"])
def test_on_two_ranks_too(tmp_path, case):
    root = make_mixed_shapes(tmp_path / "shapes")
    for counts in run_world(_two_ranks, (str(root), str(tmp_path / "run"), case), timeout=240):
        assert [c for i, c in enumerate(counts) if i != LOG_EVERY - 1] == [0] * (STEPS - 1), counts
