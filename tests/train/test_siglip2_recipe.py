"""SigLIP 2's recipe, configs/siglip2.yaml: the schedule it declares (the sigmoid loss and LocCa from
step 0, SILC and TIPS with the EMA teacher from 80% of the schedule, its last 10% stretched 3.75x),
and real runs of it through the command line: from scratch on the shapes with their regions, and
from a Hugging Face Siglip2Model folder with a fresh LocCa decoder beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
from kits.runkit import metric_rows

from vltrain.compose.decide import decide
from vltrain.config.job import load_config
from vltrain.config.stages import resolve

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "siglip2.yaml"
STEPS = 8
"""The shortest run in which the recipe's stages start at steps of their own (6 and 7, 1-based)."""
LOCCA = ("loss/caption", "loss/referring", "loss/grounded_caption")


def test_the_recipe_declares_siglip2s_schedule():
    cfg = decide(load_config(RECIPE, ["data.train=my/train.jsonl"])).cfg
    loss = cfg.model.loss
    assert cfg.model.preset == "tiny-siglip2" and cfg.model.architecture().decoder.standalone
    assert (loss.itc, loss.siglip, loss.silc, loss.tips) == (0.0, 1.0, 0.0, 0.0)
    assert min(loss.caption, loss.referring, loss.grounded_caption) > 0 and loss.parallel_prediction == 0.5
    assert cfg.model.selfdist.heads  # decided: a stage turns SILC and TIPS on
    stages = resolve(cfg.train.stages, cfg.train.max_steps, 0.0, bool(cfg.train.ema.decay))
    schedule = cfg.train.max_steps / (0.9 + 0.1 * 3.75)  # the schedule's steps before its tail is stretched
    distil, naflex = stages[1:]
    assert distil.start == round(0.8 * schedule) and naflex.start == round(0.9 * schedule)
    assert distil.teacher and distil.loss == {"silc": 0.25, "tips": 0.0625}  # SigLIP 2's 1 and 0.25 x B's 0.25
    assert naflex.lr_stretch == 3.75 and naflex.teacher and naflex.loss == distil.loss
    assert naflex.data == {"resize": "native", "max_patches": 9, "max_patches_choices": [4, 9]} and not distil.data
    assert not stages[0].teacher and stages[0].lr_stretch == 1.0


def _shapes_with_regions(root: Path) -> Path:
    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    synthesize(root, 64, 16, seed=0, with_regions=True, workers=1)
    train_tokenizer(source_texts([str(root / "train.jsonl")]), root / "tokenizer.json", vocab_size=200)
    return root


def _small(run: Path) -> list[str]:
    return [f"run.dir={run}", f"train.max_steps={STEPS}", "data.batch_size=8", "data.num_workers=0", "data.val=''",
            "train.log_every=1", "train.progress=false", "train.threads=1", "checkpoint.every=0",
            "metrics.curves=false"]


def _crossings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("stage ")]


def _assert_stage_losses(run: Path) -> None:
    """LocCa's three losses on every step; SILC's and TIPS's from the self-distillation stage (step 6) on."""
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert all(r[k] > 0 for k in LOCCA) and r["loss/siglip"] > 0, r
        assert ("loss/silc" in r) == ("loss/tips" in r) == (r["step"] >= 6), r
    assert all(r["loss/silc"] > 0 and r["loss/tips"] > 0 for r in rows[5:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_recipe_trains_through_its_stages_on_shapes_with_regions(tmp_path, cli):
    shapes = _shapes_with_regions(tmp_path / "shapes")
    run = tmp_path / "run"
    proc = cli("train", RECIPE, f"data.train={shapes / 'train.jsonl'}", f"data.tokenizer={shapes / 'tokenizer.json'}",
               *_small(run))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _crossings(proc.stderr) == [
        "stage 1 (self-distillation) from step 6: loss weights silc 0.25, tips 0.0625; the EMA teacher on, started "
        "from the student's weights",
        "stage 2 (naflex) from step 7: images resize native, max_patches 9, max_patches_choices [4, 9]; the "
        "learning-rate schedule 3.75x slower"], proc.stderr[-4000:]
    _assert_stage_losses(run)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_recipe_from_a_siglip2_checkpoint_with_a_fresh_locca_decoder(tmp_path, cli):
    """`vltrain train configs/siglip2.yaml model.init=FOLDER model.locca=true` on a tiny random
    Siglip2Model (NaFlex) made by transformers' classes: its encoders, a fresh decoder, the recipe's
    stages. The recipe's data section is the shapes', so the checkpoint's preprocessing is given back."""
    pytest.importorskip("transformers")
    from kits.pretrainedkit import IMAGE, POSITIONS, make_siglip2

    shapes = _shapes_with_regions(tmp_path / "shapes")
    make_siglip2(tmp_path / "siglip2")
    run = tmp_path / "run"
    proc = cli("train", RECIPE, f"model.init={tmp_path / 'siglip2'}", "model.locca=true",
               f"data.train={shapes / 'train.jsonl'}", "data.tokenizer=''", f"data.image_size={IMAGE}",
               f"data.max_text_length={POSITIONS}", "model.selfdist.local_size=16", *_small(run))
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = load_config(run / "config.yaml")
    assert saved.model.preset == "" and saved.model.arch["decoder"] is None  # the checkpoint has none
    assert saved.model.locca and saved.model.architecture().decoder.standalone  # model.locca adds it
    assert saved.data.resize == "native"  # the checkpoint's NaFlex preprocessing, where the recipe sets none
    assert [line.split(":")[0] for line in _crossings(proc.stderr)] == [
        "stage 1 (self-distillation) from step 6", "stage 2 (naflex) from step 7"]
    _assert_stage_losses(run)
