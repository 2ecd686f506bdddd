"""Preemption: SIGTERM to the torchrun agent mid-epoch ends the run with a checkpoint of the step
it was on, and the resumed run ends bit-identical to one never stopped."""

from __future__ import annotations

import json

import pytest
from kits.runkit import assert_identical, assert_resumed_exactly, final_state, ok, reference, session_shapes, train


@pytest.mark.timeout(300)
def test_sigterm_to_the_agent_saves_the_current_step_and_resumes_exactly(tmp_path_factory, tmp_path):
    shapes, run = session_shapes(tmp_path_factory), tmp_path / "run"
    # rank 0 sends SIGTERM to its torchrun agent after step 5 (checkpoints fall at 4 and 8), as
    # Slurm does before a preemption; the agent forwards it to both workers
    stopped = train(shapes, run, fault="preempt:at=step:step=5:rank=0", timeout=120)
    assert stopped.returncode != 0  # torchrun itself exits 1 when signalled
    marker = json.loads((run / "preempted.json").read_text())
    step = marker["step"]
    assert step in (5, 6), marker  # the step boundary where the ranks agreed
    assert (run / "checkpoints" / f"step-{step}" / "state.json").exists()
    assert f"vltrain: stopped: SIGTERM at step {step}" in stopped.stderr
    assert "failed" not in stopped.stderr.split("SignalException")[0]  # no rank reports a failure

    resumed = ok(train(shapes, run))
    assert_resumed_exactly(resumed, run, step)
    assert not (run / "preempted.json").exists()
    assert_identical(final_state(reference(tmp_path_factory, "tiny-clip")), final_state(run))


def test_one_process_exits_75_with_a_checkpoint(tmp_path_factory, tmp_path, cli):
    import os

    from kits.runkit import overrides

    shapes = session_shapes(tmp_path_factory)
    os.environ["VLTRAIN_FAULT"] = "preempt:at=step:step=3"
    try:
        proc = cli("train", shapes / "base.yaml", *overrides(shapes, tmp_path / "run", data__num_workers=0))
    finally:
        del os.environ["VLTRAIN_FAULT"]
    assert proc.returncode == 75, proc.stderr[-2000:]
    step = json.loads((tmp_path / "run" / "preempted.json").read_text())["step"]
    assert (tmp_path / "run" / "checkpoints" / f"step-{step}").is_dir()
