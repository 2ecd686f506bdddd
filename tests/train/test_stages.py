"""train.stages in real runs: the crossing said once and taking effect at its step, the EMA teacher
started from the student where a stage turns it on, the same curve on any split of the global batch,
and a run stopped on either side of a boundary (or at it) resumed bit-identical. Real processes
(gloo), 1 and 2 ranks."""

from __future__ import annotations

import json
import pytest
import torch
from kits.runkit import (assert_identical, assert_resumed_exactly, final_state, from_checkpoint, losses, metric_rows,
                         model_distance, ok, session_shapes, train, worst)
from safetensors.torch import load_file

from vltrain.checkpoint.manager import find_checkpoint
from vltrain.checkpoint.storage import read_tensors
from vltrain.data.ids import stable_uid

STAGES = ("[{at: 3, loss: {itc: 2.0, image_mim: 0.6}, patch_dropout: 0.25, name: doubled}, "
          "{at: 6, teacher: true, loss: {silc: 1.0, tips: 0.25}, lr_stretch: 2.0, image_size: 48, name: teacher}, "
          "{at: 8, resize: native, max_patches: 16, max_patches_choices: [4, 16], name: naflex}]")
HEADS = {"model__selfdist__prototypes": 64, "model__selfdist__hidden": 32, "model__selfdist__bottleneck": 16,
         "model__selfdist__local_views": 3, "model__selfdist__local_size": 16}
"""SILC's and TIPS's heads and views at a size for 32-pixel shapes."""
STAGED = {"train__stages": STAGES, "train__ema__decay": 0.8, "model__loss__image_mim": 0.3,
          "checkpoint__save_initial": "always", "train__log_every": 1, "data__audit": "true", **HEADS}
"""ITC and MIM (a weighted mean over the step) doubled from step 4 with patch dropout; from step 7
the EMA teacher, SILC and TIPS, with the schedule's tail stretched 2x, at 48 pixels (the position
table resized from 2 x 2 patches to 3 x 3); from step 9 the images at
their own shape, each step's sequence length drawn from 4 and 16 patches (NaFlex)."""
G = 8


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    shapes = session_shapes(tmp_path_factory)
    root = tmp_path_factory.mktemp("stages")
    runs = {}
    alone = {"checkpoint__every": 0}  # the first run's step 4 is read; the others' last step alone
    for name, nproc, extra in (("2 ranks", 2, {}), ("1 rank, A=2", 1, {"data__micro_batch_size": G // 2, **alone}),
                               ("2 ranks, FSDP2", 2, {"train__parallelism": "fsdp", **alone})):
        run_dir = root / name.replace(" ", "_").replace(",", "")
        runs[name] = (run_dir, ok(train(shapes, run_dir, nproc=nproc, timeout=240, data__global_batch_size=G,
                                        **STAGED, **extra)))
    return shapes, runs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_crossing_is_said_once_and_takes_effect_at_its_step(staged):
    _, runs = staged
    run_dir, proc = runs["2 ranks"]
    said = [line for line in proc.stderr.splitlines() if line.startswith("stage ")]
    assert said == ["stage 1 (doubled) from step 4: loss weights itc 2, image_mim 0.6; patch dropout 0.25",
                    "stage 2 (teacher) from step 7: loss weights silc 1, tips 0.25; the EMA teacher on, started from "
                    "the student's weights; images image_size 48; the learning-rate schedule 2x slower",
                    "stage 3 (naflex) from step 9: images resize native, max_patches 16, max_patches_choices [4, 16]"
                    ], said
    rows = metric_rows(run_dir)
    for r in rows:  # the optimised total is the stage's weights times the logged losses
        itc, mim = (1.0, 0.3) if r["step"] <= 3 else (2.0, 0.6)
        silc, tips = (r.get("loss/silc", 0.0), r.get("loss/tips", 0.0))
        assert ("loss/silc" in r) == ("loss/tips" in r) == (r["step"] >= 7), r
        assert r["loss"] == pytest.approx(itc * r["loss/itc"] + mim * r["loss/image_mim"] + silc + 0.25 * tips,
                                          rel=1e-5), r
    lr = [r["lr"] for r in rows]
    assert lr[7] > lr[6] * 0.5 and lr[9] > 0.0  # the stretched tail has not reached its end
    assert "stages:" in (run_dir / "config.yaml").read_text() and "name: teacher" in (run_dir / "config.yaml").read_text()
    # the loader of the last stage: the same data position, images at their own shape, 4 or 16 patches a step
    batches = [r for f in (run_dir / "audit").glob("rank*.jsonl") for r in map(json.loads, f.read_text().splitlines())
               if r["kind"] == "batch"]
    assert len(batches) == 2 * 10 and len({tuple(b["ids"]) for b in batches}) == 20
    native = [b for b in batches if "patches" in b]
    assert len(native) == 2 * 2 and {b["patches"] for b in native} <= {4, 16}
    ended = final_state(run_dir)  # the table and its average at 3 x 3 patches and the class token
    assert ended["model.vision.pos_embed"].shape[0] == ended["ema.weights.vision.pos_embed"].shape[0] == 1 + 9


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_teacher_is_the_student_at_its_first_step_and_averages_from_there(staged):
    run_dir, _ = staged[1]["2 ranks"]
    init = load_file(run_dir / "init.safetensors")
    before = read_tensors(find_checkpoint(run_dir / "checkpoints" / "step-4"))  # stage 1: no teacher yet
    names = [k.removeprefix("ema.weights.") for k in before if k.startswith("ema.weights.")]
    assert names and all(torch.equal(before[f"ema.weights.{n}"], init[n].float()) for n in names)
    ended = final_state(run_dir)
    moved = [n for n in names if not torch.equal(ended[f"ema.weights.{n}"], ended[f"model.{n}"])]
    assert moved and all(not torch.equal(ended[f"ema.weights.{n}"], init[n].float()) for n in moved)
    # SILC's and TIPS's heads waited for their stage as they were made (no update, no decay), then trained
    heads = [n for n in names if n.startswith("selfdist.")]
    assert heads and all(torch.equal(before[f"model.{n}"], init[n]) for n in heads)
    assert all(not torch.equal(ended[f"model.{n}"], init[n]) for n in heads)
    # the teacher's centres moved from zero on the global batch's mean logits
    assert all(before[f"model.selfdist.{h}.centre"].abs().sum() == 0 for h in ("silc", "tips"))
    assert all(ended[f"model.selfdist.{h}.centre"].abs().sum() > 0 for h in ("silc", "tips"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_global_batch_split_two_ways_trains_the_same_model_through_every_stage(staged):
    _, runs = staged
    ref, _ = runs["2 ranks"]
    assert len(losses(ref)) == 10
    for name in ("1 rank, A=2", "2 ranks, FSDP2"):  # FSDP2: the teacher's pass on sharded weights
        other, _ = runs[name]
        assert worst(losses(other), losses(ref)) < 1e-5, name
        assert model_distance(final_state(other), final_state(ref)) < 1e-5, name
        assert model_distance(final_state(other), final_state(ref), "ema.weights.") < 1e-5, name


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("parallelism, at", [("ddp", 5), ("ddp", 4), ("fsdp", 3)],
                         ids=["ddp-stopped-before", "ddp-stopped-at", "fsdp-stopped-after"])
def test_a_run_stopped_beside_a_boundary_resumes_bit_identical(parallelism, at, tmp_path_factory, tmp_path):
    """The checkpoint of step 4: one step before the teacher's stage, at it (its first step next), or
    one step after it."""
    shapes = session_shapes(tmp_path_factory)
    knobs = {"train__parallelism": parallelism, "train__ema__decay": 0.8, "model__loss__image_mim": 0.3, **HEADS,
             "train__stages": f"[{{at: {at}, teacher: true, loss: {{itc: 2.0, silc: 1.0, tips: 0.25}}, lr_stretch: 1.5, "
                              "image_size: 48, resize: native, max_patches: 16, max_patches_choices: [4, 16]}]"}
    ok(train(shapes, ref := tmp_path / "ref", **knobs))
    run = from_checkpoint(ref, tmp_path / "run")
    proc = ok(train(shapes, run, **knobs))
    assert_resumed_exactly(proc, run, 4)
    assert ("stage 1 from step" in proc.stderr) == (at > 4 or at == 4)
    assert_identical(final_state(ref), final_state(run))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_micro_batches_without_an_image_run_the_views_passes_and_do_not_hang(tmp_path_factory, tmp_path):
    """Two rows per rank from data that is two-thirds text: some rank's micro-batch holds no image in
    some step (the audit shows it), and the run ends with SILC and TIPS on from the first stage."""
    shapes = session_shapes(tmp_path_factory)
    rows = [json.loads(x) for x in (shapes / "train.jsonl").read_text().splitlines()]
    mostly_text = [r if i % 3 == 0 else {k: v for k, v in r.items() if k != "image"} for i, r in enumerate(rows)]
    data = shapes / "mostly-text.jsonl"  # beside the images its rows name
    data.write_text("".join(json.dumps(r) + "\n" for r in mostly_text))
    has_image = {stable_uid(r["id"]): "image" in r for r in mostly_text}
    run_dir = tmp_path / "run"
    ok(train(shapes, run_dir, data__train=data, data__batch_size=2, data__audit="true", train__max_steps=8,
             train__ema__decay=0.8, train__log_every=1, checkpoint__every=0, **HEADS,
             train__stages="[{at: 1, teacher: true, loss: {silc: 1.0, tips: 0.25}}]"))
    batches = [r for f in (run_dir / "audit").glob("rank*.jsonl") for r in map(json.loads, f.read_text().splitlines())
               if r["kind"] == "batch"]
    assert any(not any(has_image[i] for i in b["ids"]) for b in batches if b["step"] >= 1)
    assert all("loss/silc" in r for r in metric_rows(run_dir) if r["step"] >= 2)
