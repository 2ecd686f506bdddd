"""Dense sets, the patch labels of their masks, and the linear probe on frozen patch tokens
(vltrain.eval.dense)."""

import contextlib
import dataclasses
import json

import pytest
import torch
from PIL import Image

from vltrain.compose.task import Task
from vltrain.data.config import DataConfig
from vltrain.data.tools.synth import synthesize
from vltrain.errors import DataError, UserError
from vltrain.eval.dense import DenseSet, evaluate_dense, open_dense, patch_labels, probe_scores
from vltrain.eval.embedding import Encoder
from vltrain.model import build_model
from vltrain.model.config import LossConfig, ModelConfig
from vltrain.model.presets import tiny_clip
from vltrain.objectives.scoring import Objectives


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    synthesize(root, num=0, val=48, seed=5, workers=1, with_masks=True)
    return root / "dense.jsonl"


def _encoder(seed: int = 0) -> Encoder:
    """A random tiny-clip tower with patches of 4 on the shapes' 48 x 48 images: 12 x 12 patches,
    4 x 4 to a grid cell, so a shape covers whole patches."""
    torch.manual_seed(seed)
    arch = tiny_clip()
    arch = dataclasses.replace(arch, vision=dataclasses.replace(arch.vision, patch_size=4))
    model = build_model(ModelConfig(preset="", arch=dataclasses.asdict(arch)), vocab_size=50, pad_id=0, mask_id=1,
                        image_size=48, max_text_length=8)
    task = Task(model, Objectives(LossConfig(), model.spec))
    return Encoder(task, DataConfig(image_size=48, num_workers=0), torch.device("cpu"), contextlib.nullcontext)


def _dense(encoder: Encoder, task: DenseSet) -> dict:
    return evaluate_dense(encoder, encoder.wrapped.model, task, rank=0, world_size=1, batch_size=16)


def test_the_probe_reads_the_shapes_from_a_random_towers_patches_and_not_from_wrong_masks(shapes):
    """Above chance on true masks; trained on masks of other images (the test half's own kept), the
    same probe does clearly worse: the figure measures the features' hold on the masks."""
    encoder = _encoder()
    task = open_dense("shapes", shapes)
    true = _dense(encoder, task)
    half = len(task.masks) // 2
    wrong = dataclasses.replace(task, masks=task.masks[1:half] + task.masks[:1] + task.masks[half:])
    shuffled = _dense(encoder, wrong)
    assert true["dense/shapes/num_train"] == 24 and true["dense/shapes/num_images"] == 24
    assert true["dense/shapes/iou_background"] > 0.9
    # all background would score iou_background (< 1) over the 7 classes present: < 0.15
    assert true["dense/shapes/miou"] > 0.25 and true["dense/shapes/num_classes"] >= 3
    assert true["dense/shapes/miou"] > shuffled["dense/shapes/miou"] + 0.1
    assert _dense(encoder, task) == true  # deterministic


def test_a_constant_feature_gets_only_the_majority_class():
    labels = torch.tensor([[0, 0, 0, 1], [0, 0, 2, 1], [0, 0, 0, 2], [0, 0, 1, 0]])
    iou, present = probe_scores(torch.ones(4, 4, 3), labels, 3, train=2)
    assert present.tolist() == [True, True, True]
    assert iou.tolist() == [pytest.approx(6 / 8), 0.0, 0.0]  # everything background: 6 of the 8 scored patches


def test_each_patch_takes_the_class_of_most_of_its_pixels():
    mask = torch.zeros(8, 8, dtype=torch.uint8)
    mask[0:4, 4:8] = 2  # the top right patch, whole
    mask[4:7, 0:4] = 1  # three quarters of the bottom left
    mask[4:5, 4:8] = 3  # a quarter of the bottom right
    assert patch_labels(mask, 2, "crop").tolist() == [0, 2, 1, 0]
    wide = torch.cat([torch.full((8, 2), 3, dtype=torch.uint8), mask, torch.full((8, 2), 3, dtype=torch.uint8)], 1)
    assert patch_labels(wide, 2, "crop").tolist() == [0, 2, 1, 0]  # the centre square the model sees


def _set(tmp_path, rows, classes=("background", "thing"), size=(8, 8), mask_size=(8, 8), value=1):
    Image.new("RGB", size).save(tmp_path / "a.png")
    Image.new("L", mask_size, value).save(tmp_path / "m.png")
    (tmp_path / "d_classes.json").write_text(json.dumps(list(classes)))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_dense_sets_are_named_by_file_and_row(tmp_path):
    ok = {"image": "a.png", "mask": "m.png"}
    task = open_dense("d", _set(tmp_path, [ok, ok]))
    assert task.classes == ["background", "thing"] and task.masks[0].shape == (8, 8)
    with pytest.raises(UserError, match="cannot read .*nowhere.jsonl"):
        open_dense("d", tmp_path / "nowhere.jsonl")
    with pytest.raises(DataError, match=r"d.jsonl:2: cannot read .*gone.png"):
        open_dense("d", _set(tmp_path, [ok, {"image": "gone.png", "mask": "m.png"}]))
    with pytest.raises(DataError, match=r"d.jsonl:1: mask .*m.png is 6x8 but its image .*a.png is 8x8"):
        open_dense("d", _set(tmp_path, [ok, ok], mask_size=(6, 8)))
    with pytest.raises(DataError, match=r"d.jsonl:1: mask .*m.png holds class 2, past the 2 classes"):
        open_dense("d", _set(tmp_path, [ok, ok], value=2))
    with pytest.raises(DataError, match=r"d.jsonl:2: a dense row is"):
        open_dense("d", _set(tmp_path, [ok, {"image": "a.png"}]))
    (tmp_path / "d_classes.json").unlink()
    with pytest.raises(UserError, match="cannot read .*d_classes.json, the class names of .*d.jsonl"):
        open_dense("d", tmp_path / "d.jsonl")


def test_vltrain_eval_dense_probes_a_trained_run(cli, tmp_path_factory):
    """The command line end to end: a run's model opened through the one door, its dense set from
    ``data synth --masks`` at the run's image size, the metrics beside nothing else."""
    from kits.runkit import ok, session_shapes, train

    shapes = session_shapes(tmp_path_factory)
    run = tmp_path_factory.getbasetemp() / "dense-run"
    ok(train(shapes, run, nproc=1, train__max_steps=2, checkpoint__every=0))
    data = tmp_path_factory.mktemp("dense-cli")
    synthesize(data, num=0, val=8, seed=1, image_size=32, workers=1, with_masks=True)
    res = cli("eval", run, "--dense", data / "dense.jsonl", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = json.loads(res.stdout)
    assert set(metrics) >= {"dense/dense/miou", "dense/dense/iou_background", "dense/dense/num_train"}
    assert not any(k.startswith(("i2t", "zeroshot", "referring")) for k in metrics)
    assert metrics["dense/dense/num_train"] == 4 and 0 <= metrics["dense/dense/miou"] <= 1
    # tiny-clip's patches are as large as a shape at 32 px: a set with one class at patch level says so
    assert (metrics["dense/dense/num_classes"] >= 2) == ("so its mIoU tells nothing" not in res.stderr)
