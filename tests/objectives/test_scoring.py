"""The objectives' masks: drawn once per micro-batch, counted for the step's denominators and scored."""

from __future__ import annotations

from dataclasses import replace

import torch
from kits.modelkit import make_batch, small_task

from vltrain.objectives import scoring
from vltrain.objectives.keyed import StepKey
from vltrain.compose.task import Score

LOSSES = {"itm": 0.5, "mlm": 0.3, "text_mlm": 0.2, "image_mim": 0.5, "image_mim_paired": True}


def _micro():
    """Paired, text-only and image-only rows, with row weights, keyed by a training step."""
    batch = make_batch(8, seed=5, has_image=[1, 1, 1, 1, 0, 0, 1, 1], has_text=[1, 1, 1, 1, 1, 1, 0, 0],
                       weights=True)
    return replace(batch, key=StepKey(seed=3, step=7))


def test_the_masks_counted_are_the_masks_scored_and_drawn_once(monkeypatch):
    task = small_task("tiny-albef", **LOSSES)
    objectives = task.objectives
    micro = _micro()
    torch.manual_seed(0)
    fresh = task(Score(micro))  # no masks carried: drawn when scored, as outside training
    fresh_totals = objectives.local_totals([micro])

    calls = {"tokens": 0, "patches": 0}
    mask_tokens, patch_mask = scoring.mask_tokens, scoring.Objectives._patch_mask

    def counted_tokens(*args, **kwargs):
        calls["tokens"] += 1
        return mask_tokens(*args, **kwargs)

    def counted_patches(self, *args):
        calls["patches"] += 1
        return patch_mask(self, *args)

    monkeypatch.setattr(scoring, "mask_tokens", counted_tokens)
    monkeypatch.setattr(scoring.Objectives, "_patch_mask", counted_patches)
    carried = replace(micro, masks=objectives.draw(micro))
    assert calls == {"tokens": 2, "patches": 1}  # MLM, text MLM; MIM
    totals = objectives.local_totals([carried])
    torch.manual_seed(0)
    out = task(Score(carried))
    assert calls == {"tokens": 2, "patches": 1}  # counting and scoring drew nothing more

    assert torch.equal(totals, fresh_totals)
    assert set(out.losses) == {"itc", "itm", "mlm", "text_mlm", "image_mim"}
    for name, value in fresh.losses.items():
        assert torch.equal(out.losses[name], value), name


def test_the_scored_masks_are_the_carried_ones():
    """A carried mask that picks no token leaves nothing for MLM to score."""
    task = small_task("tiny-albef", **LOSSES)
    micro = _micro()
    masks = task.objectives.draw(micro)
    masked, labels = masks.mlm
    assert (labels != -100).any()
    none = replace(masks, mlm=(micro.input_ids, torch.full_like(labels, -100)))
    out = task(Score(replace(micro, masks=none)))
    assert float(out.losses["mlm"].detach()) == 0.0 and not out.rows["mlm"].applies.any()
    assert float(task(Score(replace(micro, masks=masks))).losses["mlm"].detach()) > 0
