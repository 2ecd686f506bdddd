"""Failures of real worker processes: killed, killed while saving, raising. Nothing is lost, nothing hangs.

Faults are injected with VLTRAIN_FAULT (see vltrain.runtime.faults); a marker file makes each fire once,
so the group torchrun restarts does not fail again at the same place.
"""

from __future__ import annotations

import time

import pytest
from kits.runkit import EVERY, assert_identical, assert_resumed_exactly, final_state, ok, reference, session_shapes, train


def killed_once_under_torchrun(tmp_path_factory, tmp_path, preset: str, fault: str):
    """A 2-rank run under ``torchrun --max-restarts 3`` whose ``fault`` fires once; it must complete,
    resumed from step 4, and end identical to the uninterrupted run. Returns the run folder."""
    run = tmp_path / "run"
    proc = ok(train(session_shapes(tmp_path_factory), run, max_restarts=3, model__preset=preset,
                    fault=f"{fault}:once={tmp_path / 'fired'}"))
    assert (tmp_path / "fired").exists()
    assert_resumed_exactly(proc, run, EVERY)
    assert_identical(final_state(reference(tmp_path_factory, preset)), final_state(run))
    return run


@pytest.mark.timeout(300)
def test_sigkill_of_rank1_restarts_the_group_and_ends_identical(tmp_path_factory, tmp_path):
    killed_once_under_torchrun(tmp_path_factory, tmp_path, "tiny-clip", "kill:at=step:step=6:rank=1")


@pytest.mark.timeout(300)
def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path_factory, tmp_path):
    # rank 1 dies while step 8's checkpoint is half written: its tensors are on disk, nothing committed
    run = killed_once_under_torchrun(tmp_path_factory, tmp_path, "tiny-albef", f"kill:at=save:step={2 * EVERY}:rank=1")
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-10", "step-4", "step-8"]  # partial removed


@pytest.mark.timeout(120)
def test_a_rank_raising_stops_every_rank_and_is_named(tmp_path_factory, tmp_path):
    start = time.monotonic()
    proc = train(session_shapes(tmp_path_factory), tmp_path / "run", fault="raise:at=step:step=2:rank=1", train__timeout_s=30, timeout=90)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 90
    assert "vltrain: rank 1 failed at step 2: InjectedFault" in proc.stderr
    assert "rank: 1" in proc.stderr  # torchrun's summary names the failed rank too
    assert "[rank1]: Traceback" in proc.stderr and "[rank0]: Traceback" not in proc.stderr  # only the cause's
