"""The step's gradients do not depend on how threads split the work: at two threads, the same
batch gives the same gradients to the bit, every time.

Gathers whose backward accumulates into shared rows (ITM's negatives, packed text's positions)
would otherwise add in whatever order the threads reach them.
"""

from __future__ import annotations

import pytest
import torch
from kits.modelkit import grads, make_batch, small_task

from vltrain.compose.task import Score


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("preset,loss", [
    ("tiny-albef", {"itc": 1.0, "itm": 1.0, "mlm": 1.0}),
    ("tiny-clip", {"itc": 1.0, "siglip": 1.0}),
])
def test_gradients_are_identical_run_after_run_at_two_threads(two_threads, preset, loss):
    task = small_task(preset, **loss)
    batch = make_batch(256, seed=3, has_image=torch.arange(256) % 9 != 4, has_text=torch.arange(256) % 11 != 6)
    runs = []
    for _ in range(4):
        task.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # MLM masks and ITM negatives draw from the global generator
        task(Score(batch)).loss.backward()
        runs.append(grads(task))
    for other in runs[1:]:
        different = [k for k in runs[0] if not torch.equal(runs[0][k], other[k])]
        assert not different, f"{len(different)} gradients differ between identical steps, e.g. {different[:3]}"
