"""The guard counts skipped steps on the device and judges them when a log step settles."""

from __future__ import annotations

import pytest
import torch

from vltrain.errors import NonFiniteError
from vltrain.train.nonfinite import NonFiniteGuard


def record(guard: NonFiniteGuard, verdicts: str) -> None:
    for v in verdicts:  # "x": skipped, ".": applied
        guard.record_on_device(torch.tensor(v == "x"))


def test_a_run_that_ended_before_the_log_step_still_stops_the_run():
    guard = NonFiniteGuard(max_in_a_row=3)
    record(guard, ".xxx..")
    with pytest.raises(NonFiniteError, match="3 steps in a row by step 6"):
        guard.settle(6)


def test_runs_continue_across_settles_and_counts_add_up():
    guard = NonFiniteGuard(max_in_a_row=3)
    record(guard, "x.xx")
    assert guard.settle(4) == 3 and (guard.in_a_row, guard.total) == (2, 3)
    assert guard.settle(4) == 0  # nothing new
    record(guard, ".")
    guard.settle(5)
    assert guard.state_dict() == {"in_a_row": 0, "total": 3}
    guard.load_state_dict({"in_a_row": 2, "total": 7})
    record(guard, "x")  # the third in a row, counting the two before the resume
    with pytest.raises(NonFiniteError):
        guard.settle(9)
