"""LocCa (SigLIP 2's decoder: captions, referring expressions, grounded captions) through the real
trainer, on the shapes with regions mixed with text-only, image-only and plain image-text rows,
images at their own shape packed several to a sequence: the same curve on 1 rank x 1 micro-batch,
1 rank x 2 micro-batches and 2 ranks under DDP and under FSDP2, and a run stopped on 2 ranks and
resumed on 1 continues it. Real processes (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kits.runkit import (assert_same_training, final_state, from_checkpoint, losses, metric_rows, model_distance, ok,
                         session_shapes, train, worst)

STEPS = 10
TOL = 1e-5
G = 12
LOCCA = {"model__preset": "tiny-siglip2", "model__loss__itc": 0, "model__loss__siglip": 1,
         "model__loss__parallel_prediction": 0.5, "model__loss__caption_chunk": 64, "data__resize": "native",
         "data__max_patches": 9, "data__pack_images": "true", "data__global_batch_size": G, "train__max_steps": STEPS,
         "train__log_every": 1}
"""SigLIP 2's recipe at the test's size, its logits made 64 tokens at a time (model.loss.caption_chunk)."""
SPLITS = {"1 rank": (1, {}), "1 rank, A=2": (1, {"data__micro_batch_size": G // 2}),
          "2 ranks, DDP": (2, {}), "2 ranks, FSDP2": (2, {"train__parallelism": "fsdp"})}


def regions_data(tmp_path_factory) -> Path:
    """The session's shapes with their regions (the same rows and images), every seventh image-text
    row made image-only and every fifth image row left without regions."""
    from vltrain.data.tools.synth import synthesize

    shapes = session_shapes(tmp_path_factory)
    out = shapes / "regions-mixed.jsonl"
    if not out.exists():
        synthesize(shapes.parent / "shapes-regions", 64, 16, text_only_fraction=0.2, seed=0, image_size=32,
                   with_regions=True)
        rows = [json.loads(x) for x in (shapes.parent / "shapes-regions" / "train.jsonl").read_text().splitlines()]
        for i, row in enumerate(rows):
            row["image"] = str(shapes.parent / "shapes-regions" / row["image"]) if "image" in row else None
            if i % 7 == 3 and row["image"]:
                del row["text"]
            if i % 5 == 1:
                row.pop("regions", None)
        out.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in rows))
    return shapes


_RUNS: dict[str, Path] = {}


def split_run(tmp_path_factory, name: str) -> Path:
    if name not in _RUNS:
        shapes = regions_data(tmp_path_factory)
        nproc, extra = SPLITS[name]
        if name != "2 ranks, FSDP2":  # the one resumed from (step 4): the others save their last step alone
            extra = {**extra, "checkpoint__every": 0}
        run_dir = tmp_path_factory.mktemp("locca") / name.replace(" ", "_").replace(",", "")
        ok(train(shapes, run_dir, nproc=nproc, timeout=300, data__train=shapes / "regions-mixed.jsonl",
                 **LOCCA, **extra))
        _RUNS[name] = run_dir
    return _RUNS[name]


@pytest.mark.timeout(900)
def test_one_global_batch_split_four_ways_trains_the_same_locca_model(tmp_path_factory):
    runs = {name: split_run(tmp_path_factory, name) for name in SPLITS}
    ref = runs["1 rank"]
    rows = metric_rows(ref)
    for task in ("caption", "referring", "grounded_caption"):  # every task trains in every step
        assert all(r[f"loss/{task}"] > 0 for r in rows), task
    assert_same_training(runs, ref, STEPS, TOL)


@pytest.mark.timeout(900)
def test_stopped_on_two_ranks_and_resumed_on_one_it_continues_the_same_locca_trajectory(tmp_path_factory, tmp_path):
    shapes = regions_data(tmp_path_factory)
    unstopped = split_run(tmp_path_factory, "2 ranks, FSDP2")
    run_dir = from_checkpoint(unstopped, tmp_path / "run", 4)
    ok(train(shapes, run_dir, nproc=1, timeout=300, data__train=shapes / "regions-mixed.jsonl", **LOCCA))
    curve, base = losses(run_dir), losses(unstopped)[4:]
    assert len(curve) == STEPS - 4 and worst(curve, base) < TOL
    assert model_distance(final_state(run_dir), final_state(unstopped)) < TOL
