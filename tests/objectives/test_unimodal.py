"""Unimodal objectives (text_mlm, image_mim), per-source loss weights and per-source metrics."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kits.modelkit import grads, make_batch, max_relative_error, rows, small_task
from kits.runkit import (assert_identical, assert_resumed_exactly, final_state, finish, from_checkpoint, launch, ok,
                         session_shapes, train)

from vltrain.images import Images
from vltrain.data.batch import Batch
from vltrain.objectives.losses import mim_loss, mlm_loss
from vltrain.compose.task import Score

PAIRED, TEXT_ONLY, IMAGE_ONLY = slice(0, 4), slice(4, 7), slice(7, 10)


def _batch():
    """4 image-text rows, then 3 text-only and 3 image-only ones."""
    return make_batch(10, seed=2, has_image=[1] * 4 + [0] * 3 + [1] * 3, has_text=[1] * 7 + [0] * 3)


def _tower_grads(task, batch, tower: str) -> dict[str, torch.Tensor]:
    task.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    task(Score(batch)).loss.backward()
    return {k: v for k, v in grads(task).items() if k.startswith(f"model.{tower}.")}


def _changed(a: dict, b: dict) -> bool:
    """Beyond float reordering (a tower that runs on more rows sums in another order)."""
    error = max_relative_error(a, b)
    assert error < 1e-5 or error > 1e-3, error  # either the same or clearly not
    return error > 1e-3


@pytest.mark.parametrize("objective,unpaired,tower", [("text_mlm", TEXT_ONLY, "text"), ("image_mim", IMAGE_ONLY, "vision")])
def test_unpaired_rows_train_their_tower_only_through_their_objective(objective, unpaired, tower):
    full = _batch()
    keep = torch.cat([torch.arange(4), torch.arange(10)[IMAGE_ONLY if tower == "text" else TEXT_ONLY]])
    without = rows(full, keep)  # the same batch without the unpaired rows this objective feeds on
    off = small_task("tiny-clip")
    assert not _changed(_tower_grads(off, full, tower), _tower_grads(off, without, tower))
    on = small_task("tiny-clip", **{objective: 1.0})
    assert _changed(_tower_grads(on, full, tower), _tower_grads(on, without, tower))
    out = on(Score(full))
    assert out.losses[objective] > 0
    applies = out.rows[objective].applies
    assert applies.any() and not applies[[i for i in range(10) if i not in range(10)[unpaired]]].any()


def test_unimodal_objectives_on_paired_rows_by_config():
    task = small_task("tiny-clip", text_mlm=1.0, image_mim=1.0, text_mlm_paired=True, image_mim_paired=True)
    out = task(Score(_batch()))
    mim = out.rows["image_mim"].applies.tolist()
    assert mim == [True] * 4 + [False] * 3 + [True] * 3
    text = out.rows["text_mlm"].applies  # rows with at least one masked token
    assert text[PAIRED].any() and text[TEXT_ONLY].any() and not text[IMAGE_ONLY].any()


@pytest.mark.parametrize("has_image,has_text", [([0, 0, 0, 0], [1, 1, 1, 1]), ([1, 1, 1, 1], [0, 0, 0, 0]),
                                                ([1, 1, 1, 1], [1, 1, 1, 1])])
def test_every_parameter_gets_a_gradient_whatever_the_rows(has_image, has_text):
    """A batch without rows for an objective still runs its modules (one dummy row): SPMD-safe."""
    task = small_task("tiny-albef", itm=1.0, mlm=1.0, text_mlm=1.0, image_mim=1.0)
    task(Score(make_batch(4, has_image=has_image, has_text=has_text))).loss.backward()
    missing = [n for n, p in task.named_parameters() if p.grad is None]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for p in task.parameters())


def test_a_source_with_loss_weight_zero_changes_no_gradient():
    """Rows of weight 0 are absent from every objective: what they hold does not reach a gradient."""
    batch = replace(_batch(), row_weights=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]))
    other = replace(batch, images=Images(batch.images.pixels.clone()), input_ids=batch.input_ids.clone())
    other.images.pixels[[2, 8]] = torch.randn_like(other.images.pixels[[2, 8]])
    other.input_ids[[2, 5]] = (other.input_ids[[2, 5]] + 7) % 50 * (other.input_ids[[2, 5]] > 0)
    task = small_task("tiny-albef", itm=1.0, mlm=1.0, text_mlm=1.0, image_mim=1.0, siglip=0.5)
    a = {k: v for k, v in _all_grads(task, batch).items()}
    b = _all_grads(task, other)
    assert not _changed(a, b)
    # and the same rows with weight 1 do change it
    ones = replace(batch, row_weights=torch.ones(10))
    assert _changed(_all_grads(task, ones), _all_grads(task, replace(other, row_weights=torch.ones(10))))


def _all_grads(task, batch) -> dict[str, torch.Tensor]:
    task.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    task(Score(batch)).loss.backward()
    return grads(task)


def test_loss_weight_two_counts_a_row_twice():
    """For the per-row objectives a weight of 2 equals the row written twice."""
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 5, 11, generator=g), torch.randint(0, 11, (3, 5), generator=g)
    labels[0, :2] = -100
    twice = torch.tensor([0, 1, 1, 2])
    torch.testing.assert_close(mlm_loss(logits, labels, torch.tensor([1.0, 2.0, 1.0])),
                               mlm_loss(logits[twice], labels[twice]))
    pred, target = torch.randn(3, 4, 12, generator=g), torch.randn(3, 4, 12, generator=g)
    mask = torch.rand(3, 4, generator=g) < 0.6
    torch.testing.assert_close(mim_loss(pred, target, mask, torch.tensor([1.0, 2.0, 1.0])),
                               mim_loss(pred[twice], target[twice], mask[twice]))


def test_the_mim_gradient_does_not_flip_on_a_rounding_error():
    """A pixel predicted one float32 step above or below its target (a tie that training makes
    common) gets nearly the same gradient, so splits of a step that round differently agree; L1's
    sign would differ there by 2 / (patches x pixels). Far from the target it is L1's gradient."""
    target = torch.full((1, 2, 12), 0.5)
    grads = []
    for nudge in (1, -1):
        pred = torch.nextafter(target, target + nudge).requires_grad_()
        mim_loss(pred, target, torch.ones(1, 2, dtype=torch.bool)).backward()
        grads.append(pred.grad)
    assert (grads[0] - grads[1]).abs().max() < 1e-5  # L1: 1 / 12
    far = torch.tensor([[[1.5, -0.5]]], requires_grad=True)
    mim_loss(far, torch.zeros(1, 1, 2), torch.ones(1, 1, dtype=torch.bool)).backward()
    torch.testing.assert_close(far.grad, torch.tensor([[[0.5, -0.5]]]))


def test_source_and_modality_weights_multiply_into_row_weights():
    from vltrain.data.config import ModalityWeights

    n = 4
    batch = Batch(ids=torch.arange(n), images=Images(torch.zeros(n, 3, 8, 8, dtype=torch.uint8)),
                  has_image=torch.tensor([1, 1, 0, 1], dtype=torch.bool), has_text=torch.tensor([1, 0, 1, 1], dtype=torch.bool),
                  input_ids=torch.ones(n, 3, dtype=torch.long), attention_mask=torch.ones(n, 3, dtype=torch.long),
                  source=torch.tensor([0, 1, 1, 0]))
    inputs = batch.to_model_inputs("cpu", [0.5] * 3, [0.5] * 3, ModalityWeights(text_only=0.5, image_only=3.0), [2.0, 0.0])
    assert inputs.row_weights.tolist() == [2.0, 0.0, 0.0, 2.0]
    assert inputs.present().has_image.tolist() == [True, False, False, True]
    assert batch.to_model_inputs("cpu", [0.5] * 3, [0.5] * 3).row_weights is None


# -- through the trainer ----------------------------------------------------------------------


def _two_sources(root: Path) -> Path:
    """The session's shapes split into two sources; the second holds image-only rows too."""
    rows_ = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows_[32:]):
        if i % 3 == 0 and "image" in r:
            r.pop("text")
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_[:32]))
    (root / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_[32:]))
    cfg = root / "two-sources.yaml"
    cfg.write_text(f"data:\n  train:\n    - {{path: {root / 'a.jsonl'}, loss_weight: 2.0, name: first}}\n"
                   f"    - {{path: {root / 'b.jsonl'}, name: second}}\n")
    return cfg


def _run(cfg: Path, shapes: Path, run_dir: Path, nproc: int, batch: int, *objectives: str, val: bool = False
         ) -> list[dict]:
    overrides = [f"run.dir={run_dir}", f"data.tokenizer={shapes / 'tokenizer.json'}", *([] if val else ["data.val=''"]),
                 "data.image_size=32", "data.max_text_length=16", f"data.batch_size={batch}", "data.num_workers=0",
                 "model.preset=tiny-clip", *objectives, "train.max_steps=4", "train.log_every=2", "train.threads=1", "train.precision=fp32",
                 "train.progress=false", "eval.every=0"]
    proc = finish(launch(["train", cfg, *overrides], nproc), 240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.timeout(600)
def test_per_source_metrics_over_two_ranks_equal_one_process(tmp_path_factory, tmp_path):
    shapes = session_shapes(tmp_path_factory)
    cfg = _two_sources(shapes)
    # every objective's per-row values are the same on any world size: the global-batch ones
    # (ITC, SigLIP) and the averaged ones (text MLM, image MIM), whose denominators the ranks share
    objectives = ("model.loss.siglip=0.5", "model.loss.text_mlm=0.5", "model.loss.image_mim=0.5")
    one = _run(cfg, shapes, tmp_path / "one", 1, 8, *objectives)
    two = _run(cfg, shapes, tmp_path / "two", 2, 4, *objectives)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for name in ("first", "second"):
            assert a[f"source/{name}/samples"] == b[f"source/{name}/samples"] > 0
            for objective in ("itc", "siglip"):
                key = f"source/{name}/loss/{objective}"
                assert key in a and key in b
                assert a[key] == pytest.approx(b[key], rel=1e-5)
        assert sum(a[f"source/{n}/samples"] for n in ("first", "second")) == 8 * 2  # two steps a log line
    for key in ("source/second/loss/image_mim", "source/first/loss/text_mlm"):
        assert [key in r for r in one] == [key in r for r in two] and any(key in r for r in two)
        for a, b in zip(one, two):
            assert a.get(key, 0.0) == pytest.approx(b.get(key, 0.0), rel=1e-5)


@pytest.mark.timeout(400)
def test_unimodal_objectives_resume_bit_identical(tmp_path_factory, tmp_path):
    """The masking draws are part of the checkpointed generator state."""
    shapes = session_shapes(tmp_path_factory)
    extra = {"model__loss__text_mlm": 0.5, "model__loss__image_mim": 0.5, "model__loss__image_mim_paired": True}
    ref = tmp_path / "ref"
    ok(train(shapes, ref, **extra))
    run = from_checkpoint(ref, tmp_path / "run")
    resumed = ok(train(shapes, run, **extra))
    assert_resumed_exactly(resumed, run, 4)
    assert_identical(final_state(ref), final_state(run))


@pytest.mark.timeout(400)
def test_eval_reports_each_validation_source(tmp_path_factory, tmp_path):
    """With two sources in data.val, each gets its own recalls, equal to evaluating it alone."""
    shapes = session_shapes(tmp_path_factory)
    val = [json.loads(line) for line in (shapes / "val.jsonl").read_text().splitlines()]
    (tmp_path / "va.jsonl").write_text("".join(json.dumps({**r, "image": str(shapes / r["image"])}) + "\n" for r in val[:8]))
    (tmp_path / "vb.jsonl").write_text("".join(json.dumps({**r, "image": str(shapes / r["image"])}) + "\n" for r in val[8:]))
    cfg = tmp_path / "val.yaml"
    cfg.write_text(f"data:\n  train: {shapes / 'train.jsonl'}\n  val:\n    - {{path: {tmp_path / 'va.jsonl'}, name: va}}\n"
                   f"    - {{path: {tmp_path / 'vb.jsonl'}, name: vb}}\n")
    run = tmp_path / "run"
    _run(cfg, shapes, run, 1, 8, val=True)
    common = ["eval", run, "train.threads=1"]

    def evaluate(*extra: str) -> dict:
        proc = finish(launch([*common, *extra, "--json"]), 120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    both = evaluate()
    assert both["num_pairs"] == len(val)
    for name, n in (("va", 8), ("vb", len(val) - 8)):
        alone = evaluate("--data", str(tmp_path / f"{name}.jsonl"))
        assert both[f"val/{name}/num_pairs"] == alone["num_pairs"] == n
        assert both[f"val/{name}/t2i_r1"] == pytest.approx(alone["t2i_r1"])
        assert both[f"val/{name}/i2t_r5"] == pytest.approx(alone["i2t_r5"])


def test_masked_image_modelling_of_images_at_their_own_shape_reads_and_predicts_real_patches_only():
    """image_mim on padded native patches: the keyed mask falls on real patches only, the target is
    the patches themselves, and noise in the padding changes neither the loss nor its gradients."""
    from vltrain.images import real_patches

    task = small_task(image_mim=1.0, image_mim_paired=True)
    model, objectives = task.model, task.objectives
    p, n = model.vision.cfg.patch_size, 6
    grids = torch.tensor([[1, 2], [2, 3], [1, 1], [3, 2]])
    batch = make_batch(len(grids), seed=3)
    real = real_patches(grids, n)
    pixels = torch.randn(len(grids), n, 3 * p * p, generator=torch.Generator().manual_seed(4)) * real[..., None]
    inputs = replace(batch, images=Images(pixels, grids), counts=None)
    masks = objectives.draw(inputs)
    masked = masks.image_mim
    assert masked.shape == (4, n) and not (masked & ~real).any() and masked.any()

    def loss_and_grads(x):
        model.zero_grad(set_to_none=True)
        loss = objectives._image_mim(model, replace(inputs, images=Images(x, grids)), masks, {})
        loss.backward()
        return loss.detach(), {k: v.grad.clone() for k, v in model.vision.named_parameters() if v.grad is not None}

    base, grads_base = loss_and_grads(pixels)
    noisy, grads_noisy = loss_and_grads(pixels + 3.0 * (~real)[..., None])
    torch.testing.assert_close(noisy, base, atol=1e-6, rtol=0)
    for k in grads_base:
        torch.testing.assert_close(grads_noisy[k], grads_base[k], atol=1e-6, rtol=1e-5)
    assert base > 0
