"""Exact resume on real processes: a 2-rank run stopped mid-epoch and resumed ends bit-identical.

Two ranks on gloo, two loader workers each, shuffling on; the run dies at step 6 (all ranks,
SIGKILL: nothing is flushed), the newest checkpoint is step 4 (an epoch is 8 steps), and the
resumed run goes on across the epoch boundary to step 10. Every tensor of its final checkpoint,
the model and the optimizer's moments, must equal the uninterrupted run's to the bit.
"""

from __future__ import annotations

import json
import shutil

import pytest
from kits.runkit import (
    EVERY,
    STEPS,
    assert_identical,
    assert_resumed_exactly,
    final_state,
    ok,
    reference,
    session_shapes,
    train,
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["tiny-clip", "tiny-albef"])
def test_stop_mid_epoch_and_resume_is_bit_identical(tmp_path_factory, tmp_path, preset):
    ref = reference(tmp_path_factory, preset)
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "run"
    stopped = train(shapes, run, model__preset=preset, fault="kill:at=step:step=6")
    assert stopped.returncode != 0
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{EVERY}"

    resumed = ok(train(shapes, run, model__preset=preset))
    assert_resumed_exactly(resumed, run, EVERY)
    assert_identical(final_state(ref), final_state(run))
    states = [json.loads((r / "checkpoints" / "step-10" / "state.json").read_text())["states"] for r in (ref, run)]
    for name in ("scheduler", "loader", "trainer"):
        assert states[0][name] == states[1][name], name


@pytest.mark.timeout(180)
def test_resume_on_another_world_size_continues_by_samples_seen(tmp_path_factory, tmp_path):
    ref = reference(tmp_path_factory, "tiny-clip")
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "run"
    shutil.copytree(ref / "checkpoints", run / "checkpoints")
    saved = json.loads((run / "checkpoints" / f"step-{STEPS}" / "state.json").read_text())["states"]["loader"]

    proc = ok(train(shapes, run, nproc=1, train__max_steps=STEPS + 2, metrics__curves=True))
    assert f"at step {STEPS} (from world size 2: model and optimizer resharded" in proc.stderr
    # metrics.curves: drawn when on (the default), not when off, as in the reference run
    assert (run / "curves.png").stat().st_size > 0 and not (ref / "curves.png").exists()
    loader = json.loads((run / "checkpoints" / f"step-{STEPS + 2}" / "state.json").read_text())["states"]["loader"]
    # one rank takes half the samples per step of two: the same samples seen is twice the steps
    assert loader["sampler"]["world_size"] == 1
    assert loader["sampler"]["epoch"] == saved["sampler"]["epoch"]
    assert loader["sampler"]["consumed"] == 2 * saved["sampler"]["consumed"] + 2
