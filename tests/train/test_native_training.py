"""Training on images at their own shape (data.resize native): wide, tall and square images in one
run, ranks whose micro-batches hold different grids, the same run on 1 and 2 ranks under a global
batch, and an exact resume. Real processes (gloo on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from kits.runkit import (
    assert_identical, assert_recalls, assert_resumed_exactly, final_state, from_checkpoint, losses, metric_rows,
    model_distance, ok,
    session_shapes, train, worst,
)

from vltrain.config.job import load_config
from vltrain.data.ids import stable_uid
from vltrain.data.index.open import open_indexed
from vltrain.data.index.sizes import image_sizes
from vltrain.data.native import patch_counts
from vltrain.errors import ConfigError, UserError
from vltrain.compose.rules import fit_native, resolve_global_batch

SIZES = [(64, 16), (16, 64), (32, 32), (48, 24), (24, 48), (40, 8), (8, 40), (96, 32)]
"""(width, height) of the images, in turn: 4:1 to 1:5, from 8 to 96 pixels on a side."""
KEEP_RATIO = Path(__file__).parents[1] / "data" / "fixtures" / "img2dataset-keep-ratio"
"""Shards img2dataset wrote with resize_mode keep_ratio (tests/data/fixtures/make_img2dataset.py)."""
NATIVE = {"data__resize": "native", "data__max_patches": 8, "data__global_batch_size": 8, "data__audit": "true",
          "train__debug_spmd": "true", "train__max_steps": 12, "train__log_every": 1}


def native_shapes(tmp_path_factory) -> Path:
    """The shapes with each image resized to one of SIZES."""
    shapes = session_shapes(tmp_path_factory)
    out = shapes / "native.jsonl"
    if not out.exists():
        (shapes / "native").mkdir(exist_ok=True)
        rows = [json.loads(x) for x in (shapes / "train.jsonl").read_text().splitlines()]
        for i, row in enumerate(rows):
            if "image" in row:
                image = Image.open(shapes / row["image"]).resize(SIZES[i % len(SIZES)], Image.Resampling.BICUBIC)
                row["image"] = f"native/{i}.png"
                image.save(shapes / row["image"])
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return shapes


def different_grids_on_the_ranks(shapes: Path, run_dir: Path) -> bool:
    """Whether some step's rows on rank 0 and rank 1 had images of different sizes (from the audit)."""
    rows = [json.loads(x) for x in (shapes / "train.jsonl").read_text().splitlines()]
    size = {stable_uid(r["id"]): SIZES[i % len(SIZES)] if "image" in r else None for i, r in enumerate(rows)}
    ranks = [[json.loads(x) for x in (run_dir / "audit" / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    steps = [(a, b) for a, b in zip(*ranks) if a["kind"] == "batch"]
    assert steps
    return any({size[i] for i in a["ids"]} != {size[i] for i in b["ids"]} for a, b in steps)


def run(shapes: Path, run_dir: Path, nproc: int, every: int = 0, **extra):
    """A run of ``NATIVE``; ``every``: its checkpoints' interval (a run resumed from, or resumed, saves step 4),
    else its last step alone."""
    return train(shapes, run_dir, nproc=nproc, timeout=240,
                 **{"data__train": shapes / "native.jsonl", **NATIVE, "checkpoint__every": every, **extra})


@pytest.mark.timeout(900)
def test_two_ranks_of_mixed_grids_train_as_one_and_resume_exactly(tmp_path_factory, tmp_path):
    shapes = native_shapes(tmp_path_factory)
    two = tmp_path / "two"
    ok(run(shapes, two, 2, every=4))  # the SPMD check compares every collective's shapes across the ranks
    assert different_grids_on_the_ranks(shapes, two)
    one = tmp_path / "one"  # packed, class tokens included (tiny-clip has them)
    ok(run(shapes, one, 1, data__micro_batch_size=4, data__pack_images="true"))
    assert len(losses(two)) == 12 and worst(losses(one), losses(two)) < 1e-5
    assert model_distance(final_state(one), final_state(two)) < 1e-5

    stopped = from_checkpoint(two, tmp_path / "stopped")
    assert_resumed_exactly(ok(run(shapes, stopped, 2, every=4)), stopped, 4)
    assert_identical(final_state(stopped), final_state(two))


@pytest.mark.timeout(900)
def test_a_fusion_model_on_images_at_their_own_shape_trains_as_one_on_two_ranks(tmp_path_factory, tmp_path):
    """tiny-albef (ITC, ITM with hard negatives and MLM through the fusion encoder, and masked image
    modelling) on images at their own shape, padded and packed: the fusion reads only each image's
    real tokens, wherever its negatives come from, and MIM masks and predicts only real patches. 2
    ranks whose steps hold different grids (padded, then packed several images to a sequence) and 1
    rank with 2 micro-batches (padded) train the same model; evaluation re-ranks with ITM."""
    shapes = native_shapes(tmp_path_factory)
    fusion = {"model__preset": "tiny-albef", "model__loss__mlm": 0.5, "model__loss__image_mim": 0.5,
              "model__loss__image_mim_paired": "true", "data__val": shapes / "val.jsonl",
              "eval__itm_rerank_k": 4, "train__max_steps": 8}
    two = tmp_path / "two"
    ok(run(shapes, two, 2, **fusion))
    assert different_grids_on_the_ranks(shapes, two)
    one = tmp_path / "one"
    ok(run(shapes, one, 1, data__micro_batch_size=4, **fusion))
    assert len(losses(two)) == 8 and worst(losses(one), losses(two)) < 1e-5
    assert model_distance(final_state(one), final_state(two)) < 1e-5
    assert all(r["loss/image_mim"] > 0 for r in metric_rows(two))
    last = json.loads((two / "eval.json").read_text())[-1]
    assert last["num_pairs"] >= 8
    assert_recalls(last, "", last["num_pairs"], last["num_pairs"], rerank_k=4)
    packed = tmp_path / "packed"  # tiny-albef has a class token: one slot per packed image
    ok(run(shapes, packed, 2, data__pack_images="true", **fusion))
    assert len(losses(packed)) == 8 and worst(losses(one), losses(packed)) < 1e-5
    for name in ("loss/itm", "loss/mlm", "loss/image_mim"):
        assert worst([r[name] for r in metric_rows(one)], [r[name] for r in metric_rows(packed)]) < 1e-5
    assert model_distance(final_state(one), final_state(packed)) < 1e-5


def step_patches(run_dir: Path, max_patches: int) -> list[int]:
    """Patches in each step of a run on the keep_ratio shards, both ranks together (from the audit),
    each image counted at its grid (the folder's 8-pixel patches)."""
    source = open_indexed(f"{KEEP_RATIO}/{{00000..00001}}.tar", None, 16)
    counts = patch_counts(image_sizes(source), source.has_image(), 8, max_patches)
    patches = {stable_uid(source.row(i).key): int(counts[i]) for i in range(len(source))}
    ranks = [[json.loads(x) for x in (run_dir / "audit" / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    steps = [a["ids"] + b["ids"] for a, b in zip(*ranks) if a["kind"] == "batch"]
    return [sum(patches[i] for i in ids) for ids in steps]


@pytest.mark.timeout(900)
def test_packed_images_on_two_ranks_train_as_padded_ones_on_one(tmp_path_factory, tmp_path):
    """A tower without a class token (a tiny SigLIP 2 folder's), on img2dataset shards of images at
    their own aspect ratio (keep_ratio: 96 x 96 to 384 x 96), in steps of at most 64 patches
    (data.patch_budget), packed several to a sequence on 2 ranks, against one image per sequence on
    1 rank with 2 micro-batches; and so again with patch dropout."""
    from kits.pretrainedkit import make_siglip2

    shapes = native_shapes(tmp_path_factory)
    folder = tmp_path / "siglip2"
    make_siglip2(folder)
    init = {"model__init": folder, "data__tokenizer": "''", "data__image_size": 32, "data__max_text_length": 16,
            "data__mean": "[0.5,0.5,0.5]", "data__std": "[0.5,0.5,0.5]", "data__max_patches": 16,
            "model__preset": "''", "train__max_steps": 8, "data__train": f"'{KEEP_RATIO}/{{00000..00001}}.tar'",
            "data__batching": "budget", "data__patch_budget": 64, "data__token_budget": 128}
    packed = tmp_path / "packed"
    ok(run(shapes, packed, 2, every=4, data__pack_images="true", **init))
    patches = step_patches(packed, 16)
    # every step within the budget, and full to within one image but for the epoch's last, short one
    assert max(patches) <= 64 and sum(p > 64 - 16 for p in patches) >= len(patches) - 1
    padded = tmp_path / "padded"
    ok(run(shapes, padded, 1, data__micro_batch_size=4, **init))
    assert len(losses(packed)) == 8 and worst(losses(packed), losses(padded)) < 1e-5
    assert model_distance(final_state(packed), final_state(padded)) < 1e-5

    stopped = from_checkpoint(packed, tmp_path / "stopped")
    assert_resumed_exactly(ok(run(shapes, stopped, 2, every=4, data__pack_images="true", **init)), stopped, 4)
    assert_identical(final_state(stopped), final_state(packed))

    # patch dropout: a packed sequence holds only its images' kept patches, and trains as padded ones
    drop = {**init, "model__vision__patch_dropout": 0.5}
    dropped = tmp_path / "packed-dropout"
    ok(run(shapes, dropped, 2, data__pack_images="true", **drop))
    padded_dropped = tmp_path / "padded-dropout"
    ok(run(shapes, padded_dropped, 1, data__micro_batch_size=4, **drop))
    assert worst(losses(dropped), losses(packed)) > 1e-4  # the dropout took effect (8.9e-4 measured)
    assert len(losses(dropped)) == 8 and worst(losses(dropped), losses(padded_dropped)) < 1e-5
    assert model_distance(final_state(dropped), final_state(padded_dropped)) < 1e-5


def test_what_does_not_take_images_at_their_own_shape_is_refused(tmp_path_factory):
    shapes = session_shapes(tmp_path_factory)
    base = [f"data.tokenizer={shapes / 'tokenizer.json'}", "data.resize=native", "data.image_size=32"]
    for extra, refusal in (
        (["model.preset=tiny-clip", "data.patch_size=8"], r"data\.patch_size 8 differs from the model's patch size"),
    ):
        with pytest.raises(ConfigError, match=refusal):
            fit_native(load_config(None, base + extra))
    with pytest.raises(ConfigError, match="data.min_patches"):
        load_config(None, base + ["data.min_patches=300"])
    cfg = load_config(None, [f"data.tokenizer={shapes / 'tokenizer.json'}", "data.pack_images=true"])
    with pytest.raises(ConfigError, match="data.pack_images packs images at their own shape"):
        fit_native(cfg)
    with pytest.raises(ConfigError, match="data.patch_budget plans batches by patch count.*data.batching budget"):
        load_config(None, base + ["data.patch_budget=512"])
    with pytest.raises(ConfigError, match="data.patch_budget 100 is smaller than one image of data.max_patches"):
        load_config(None, base + ["data.batching=budget", "data.patch_budget=100"])
    cfg = load_config(None, [f"data.tokenizer={shapes / 'tokenizer.json'}", "data.batching=budget",
                             "data.patch_budget=512"])
    with pytest.raises(ConfigError, match="data.patch_budget counts the patches of images at their own shape"):
        fit_native(cfg)
    cfg = load_config(None, base + ["data.batching=budget", "data.patch_budget=600", "data.global_batch_size=16"])
    with pytest.raises(UserError, match="data.patch_budget=600 is too small .* at least 2048"):
        resolve_global_batch(cfg, 2)
