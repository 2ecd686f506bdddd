"""fp16's gradient scaler under FSDP2: an overflow in one rank's shard is skipped by every rank.

Each rank unscales only the gradient shards it holds, so the scaler's ``found_inf`` starts as a
per-rank verdict. The step agrees on it in its one packet (``vltrain.train.step.scaler_verdicts``)
before the scaler's step and update read it: one rank updating its shards while another skips
would leave a model that no single run computed, and two ranks with different loss scales.
"""

from __future__ import annotations

import json

import pytest
import torch
from kits.runkit import ok, session_shapes, train

from vltrain.checkpoint.storage import read_tensors

OVERFLOW_STEP = 2


def saved(run, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    folder = run / "checkpoints" / f"step-{step}"
    return read_tensors(folder), json.loads((folder / "state.json").read_text())["states"]["scaler"]


@pytest.mark.timeout(240)
def test_an_overflow_in_one_ranks_shard_is_skipped_by_every_rank(tmp_path_factory, tmp_path):
    run = tmp_path / "run"
    ok(train(session_shapes(tmp_path_factory), run, train__parallelism="fsdp", train__precision="fp16",
             train__max_steps=OVERFLOW_STEP + 1, checkpoint__every=1,
             fault=f"overflow:at=grad:step={OVERFLOW_STEP}:rank=0"))
    before, before_scaler = saved(run, OVERFLOW_STEP - 1)
    at, at_scaler = saved(run, OVERFLOW_STEP)
    after, _ = saved(run, OVERFLOW_STEP + 1)

    # the checkpoint holds both ranks' shards: neither moved at the overflowed step
    assert before.keys() == at.keys()
    moved = [k for k in before if not torch.equal(before[k], at[k])]
    assert not moved, f"{len(moved)} of {len(before)} tensors changed at the overflowed step, e.g. {moved[:3]}"
    assert at_scaler["scale"] == before_scaler["scale"] * before_scaler["backoff_factor"]
    assert at_scaler["_growth_tracker"] == 0
    # and the run went on: the next step updated the model on both ranks
    model = [k for k in at if k.startswith("model.")]
    assert all(not torch.equal(at[k], after[k]) for k in model if at[k].numel() > 1 and "bias" not in k)
