"""Failures of real worker processes: killed, killed while saving, raising. Nothing is lost, nothing hangs.

Faults are injected with VLTRAIN_FAULT (see vltrain.faults); a marker file makes each fire once,
so the group torchrun restarts does not fail again at the same place.
"""

from __future__ import annotations

import time

import pytest

from runkit import EVERY, assert_identical, final_state, make_shapes, ok, reference, train


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_of_rank1_restarts_the_group_and_ends_identical(tmp_path_factory, tmp_path):
    ref = reference(tmp_path_factory, "tiny-clip")
    shapes = make_shapes(tmp_path_factory.getbasetemp() / "shapes")
    run = tmp_path / "run"
    proc = ok(train(shapes, run, max_restarts=3, fault=f"kill:at=step:step=6:rank=1:once={tmp_path / 'fired'}"))
    assert (tmp_path / "fired").exists()
    assert f"resumed from {run / 'checkpoints' / f'step-{EVERY}'} at step {EVERY} (exactly)" in proc.stderr
    assert_identical(final_state(ref), final_state(run))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path_factory, tmp_path):
    ref = reference(tmp_path_factory, "tiny-albef")
    shapes = make_shapes(tmp_path_factory.getbasetemp() / "shapes")
    run = tmp_path / "run"
    # rank 1 dies while step 8's checkpoint is half written: its tensors are on disk, nothing committed
    fault = f"kill:at=save:step={2 * EVERY}:rank=1:once={tmp_path / 'fired'}"
    proc = ok(train(shapes, run, max_restarts=3, model__preset="tiny-albef", fault=fault))
    assert (tmp_path / "fired").exists()
    assert f"resumed from {run / 'checkpoints' / f'step-{EVERY}'} at step {EVERY} (exactly)" in proc.stderr
    folder = run / "checkpoints"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # the partial one was removed
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-10", "step-4", "step-8"]
    assert_identical(final_state(ref), final_state(run))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_raising_stops_every_rank_and_is_named(tmp_path_factory, tmp_path):
    shapes = make_shapes(tmp_path_factory.getbasetemp() / "shapes")
    start = time.monotonic()
    proc = train(shapes, tmp_path / "run", fault="raise:at=step:step=2:rank=1", train__timeout_s=30, timeout=90)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 90
    assert "vltrain: rank 1 failed at step 2: InjectedFault" in proc.stderr
    assert "rank: 1" in proc.stderr  # torchrun's summary names the failed rank too
