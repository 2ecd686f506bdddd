"""train.stages as loaded: the list checked as a whole (one line naming the stage), the values each
stage holds, and the learning-rate schedule a stretch slows down."""

from __future__ import annotations

import math

import pytest

from vltrain.config.job import load_config
from vltrain.config.stages import resolve, stage_at, stretches
from vltrain.errors import ConfigError
from vltrain.train.optim import WarmupCosine


def stages(text: str, *extra: str):
    return load_config(None, ["train.max_steps=100", f"train.stages={text}", *extra])


@pytest.mark.parametrize("text, says", [
    ("[{at: 1.5}]", "train.stages stage 1: at=1.5 is a fraction of train.max_steps and must lie in (0, 1)"),
    ("[{at: 80}, {at: 0.5, name: late}]", "train.stages stage 2 (late): starts at step 50, not after the stage "
                                          "before it (step 80)"),
    ("[{at: 100}]", "train.stages stage 1: starts at step 100, outside the run's steps 1 to 99"),
    ("[{at: 0.5, loss: {sigmoid: 1}}]", "train.stages stage 1: loss names 'sigmoid', not a weight of model.loss"),
    ("[{at: 0.5, loss: {itc: -1}}]", "train.stages stage 1: loss itc=-1.0 must be a finite weight >= 0"),
    ("[{at: 0.5, loss: {image_mim: 1}}]", "turns an objective on that is off in stage 0 (model.loss.image_mim=0)"),
    ("[{at: 0.5, patch_dropout: 1.0}]", "train.stages stage 1: patch_dropout=1.0 must lie in [0, 1)"),
    ("[{at: 0.5, lr_stretch: 0.5}]", "train.stages stage 1: lr_stretch=0.5 must be >= 1"),
    ("[{at: 0.5, teacher: true}]", "train.stages stage 1: teacher: true is the EMA of the student, and "
                                   "train.ema.decay is 0"),
])
def test_a_list_that_contradicts_itself_is_one_line_naming_the_stage(text, says):
    with pytest.raises(ConfigError) as e:
        stages(text)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_each_stage_holds_what_it_sets_and_what_the_stages_before_it_set():
    cfg = stages("[{at: 0.3, loss: {itc: 2}, patch_dropout: 0.5}, {at: 60, teacher: true, lr_stretch: 3.75}, "
                 "{at: 0.9, loss: {siglip: 1}, patch_dropout: 0}]", "train.ema.decay=0.99")
    tc = cfg.train
    found = resolve(tc.stages, tc.max_steps, 0.0, True)
    assert [s.start for s in found] == [0, 30, 60, 90]
    assert [s.loss for s in found] == [{}, {"itc": 2.0}, {"itc": 2.0}, {"itc": 2.0, "siglip": 1.0}]
    assert [s.patch_dropout for s in found] == [0.0, 0.5, 0.5, 0.0]
    assert [s.teacher for s in found] == [False, False, True, True]  # train.ema waits for the stage
    assert [s.lr_stretch for s in found] == [1.0, 1.0, 3.75, 3.75]
    assert [stage_at(found, k).number for k in (0, 29, 30, 59, 60, 89, 90, 99)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert stretches(found) == ((30, 1.0), (60, 3.75), (90, 3.75))
    assert resolve([], 100, 0.25, True)[0].teacher and not resolve([], 100, 0.25, False)[0].teacher


def test_a_stretch_slows_the_schedule_from_its_stage_and_ends_it_at_the_last_step():
    plain = WarmupCosine(10, 100, 0.0)
    stretched = WarmupCosine(10, 100, 0.0, stretches=((60, 4.0),))
    assert [stretched(k) for k in range(61)] != [plain(k) for k in range(61)]  # the end comes later in time
    # the schedule time: 60 steps, then 40 steps at a quarter: 70 in all
    same_shape = WarmupCosine(10, 70, 0.0)
    for k in range(0, 61):
        assert stretched(k) == pytest.approx(same_shape(k), abs=1e-12)
    assert stretched(80) == pytest.approx(same_shape(65), abs=1e-12)
    assert stretched(100) == pytest.approx(0.0, abs=1e-12)
    # without a stretch, the same numbers as ever, bit for bit
    assert all(WarmupCosine(10, 100, 0.1, stretches=())(k) == 0.1 + 0.9 * 0.5 * (1 + math.cos(
        math.pi * min(1.0, (k - 10) / 90))) for k in range(10, 101))


def test_the_decided_config_keeps_the_stages_and_refuses_writes(tmp_path):
    from vltrain.compose.decide import decide

    cfg = stages("[{at: 0.5, loss: {itc: 2}, name: doubled}]")
    decided = decide(cfg, 1, "train").cfg
    with pytest.raises(AttributeError):
        decided.train.stages[0].at = 0.7
    decided.save(tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.train.stages == cfg.train.stages


def test_a_model_opened_after_training_sees_images_as_the_last_stage_did():
    from vltrain.compose.decide import decide

    cfg = stages("[{at: 0.5, resize: native, max_patches: 64}, {at: 0.8, max_patches_choices: [16, 64]}]")
    trained = decide(cfg, 1, "train").cfg
    assert trained.data.resize == "crop" and trained.data.patch_size > 0  # stage 0; the native side decided
    opened = decide(cfg, 1, "eval").cfg
    assert (opened.data.resize, opened.data.max_patches, opened.data.max_patches_choices) == ("native", 64, [16, 64])


def test_a_stage_that_changes_the_images_is_checked_as_data_would_be():
    with pytest.raises(ConfigError, match=r"train.stages stage 2: data.max_patches_choices \[512\] outside"):
        stages("[{at: 0.5, resize: native}, {at: 0.8, max_patches_choices: [512]}]")
    with pytest.raises(ConfigError, match="train.stages stage 1: a stage that changes the images needs data.batching"):
        stages("[{at: 0.5, resize: native}]", "data.batching=budget")
