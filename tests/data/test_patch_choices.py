"""data.max_patches_choices: each optimizer step's patch budget drawn from a list (SigLIP 2's NaFlex
stage), keyed by the seed and the step's place in the data order: the same on every rank and
micro-batch of the step, on any split of the global batch and after a resume; its images resized
within it and its batch padded to it. Real processes (gloo) for the splits and the resume."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
from PIL import Image
from kits.datafiles import caption, distinct_image, save, tiny_tokenizer, write_jsonl
from kits.runkit import (assert_identical, assert_resumed_exactly, final_state, from_checkpoint, losses, ok,
                         session_shapes, train, worst)
from kits.sampler_fixtures import table

from vltrain.compose.rules import resolve_global_batch
from vltrain.config.job import load_config
from vltrain.data.config import DataConfig
from vltrain.data.dataset import build_dataset
from vltrain.data.image_input import image_layout
from vltrain.data.native import native_grid
from vltrain.data.loading.loader import _SeededBatches, build_train_loader, step_patches
from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule
from vltrain.errors import ConfigError

CHOICES = [1, 4, 9, 16]
"""On the shapes' 32 x 32 images in 16-pixel patches: 1 x 1, 2 x 2, 3 x 3 and 4 x 4 grids."""


def test_the_budget_is_a_function_of_the_seed_and_the_step():
    drawn = [step_patches(CHOICES, 7, 0, s) for s in range(64)]
    assert drawn == [step_patches(CHOICES, 7, 0, s) for s in range(64)]
    assert set(drawn) == set(CHOICES)  # every choice comes up, so steps differ
    assert drawn != [step_patches(CHOICES, 8, 0, s) for s in range(64)]
    assert drawn != [step_patches(CHOICES, 7, 1, s) for s in range(64)]


def step_budgets(world: int, micro: int, global_batch: int = 8) -> dict[tuple[int, int], set]:
    """(epoch, optimizer step) -> the budgets its keys carry and its rows, over every rank and
    micro-batch, for two epochs of a split of ``global_batch`` into ``world`` ranks of ``micro`` rows."""
    out: dict = defaultdict(set)
    t = table([4] * 40)
    for rank in range(world):
        sampler = DistributedBatchSampler(t, Schedule(batch_size=micro, seed=3, global_batch=global_batch),
                                          rank=rank, world_size=world)
        per_epoch, per_step = len(sampler), global_batch // (world * micro)
        for k, keys in zip(range(2 * per_epoch), _SeededBatches(sampler, CHOICES)):
            step = (k // per_epoch, k % per_epoch // per_step)
            out[step] |= {("budget", m) for _, _, m in keys} | {("row", i) for i, _, _ in keys}
    return out


def test_every_micro_batch_and_rank_of_a_step_carries_its_budget():
    one, two = step_budgets(1, 4), step_budgets(2, 4)  # 1 rank x 2 micro-batches, 2 ranks x 1
    assert one == two
    budgets = [{m for kind, m in keys if kind == "budget"} for keys in one.values()]
    assert all(len(b) == 1 for b in budgets) and len(set.union(*budgets)) > 1


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_images_are_resized_within_their_steps_budget(tmp_path, tok):
    """A 160 x 80 image and a small one, through the training loader: each batch is padded to its
    step's budget, every grid within it, and the large image's grid grows with the budget."""
    rows = [{"id": f"r{i}", "image": f"img/{i}.png", "text": caption(i)} for i in range(4)]
    for i in range(4):
        save(distinct_image(i, (8, 12)), tmp_path / "img" / f"{i}.png")
    Image.new("RGB", (160, 80), (200, 10, 10)).save(tmp_path / "img" / "0.png")
    cfg = DataConfig(train=str(write_jsonl(tmp_path / "m.jsonl", rows)), image_size=8, max_text_length=16,
                     resize="native", max_patches=64, patch_size=4, max_patches_choices=[8, 18, 32, 64],
                     batch_size=4, shuffle=False, num_workers=0)
    loader = build_train_loader(cfg, build_dataset(cfg, "train", tok, plan_aware=True), rank=0, world_size=1,
                                seed=5, run_dir=None, pad_id=tok.pad_id)
    grid_at = {}
    for step in range(12):
        batch = next(loader)
        budget = step_patches(cfg.max_patches_choices, 5, step, 0)  # one step per epoch
        assert batch.images.pixels.shape == (4, budget, 48)
        assert all(int(g.prod()) <= budget for g in batch.images.grids)
        grid_at[budget] = tuple(batch.images.grids[0].tolist())
    assert len(grid_at) > 1
    assert all(grid == native_grid(80, 160, 4, budget) for budget, grid in grid_at.items())
    sides = [grid_at[b] for b in sorted(grid_at)]
    assert all(a[0] <= b[0] and a[1] < b[1] for a, b in zip(sides, sides[1:])), grid_at
    unplanned = build_dataset(cfg, "train", tok)[0]  # outside training (evaluation): data.max_patches
    assert unplanned.image.shape[0] == math.prod(native_grid(80, 160, 4, 64)) and unplanned.max_patches == 0


def config(*extra: str, world: int = 1):
    shapes = ["data.train=x.jsonl", "data.resize=native", "data.max_patches=16", "model.preset=tiny-clip"]
    cfg = load_config(None, shapes + list(extra))
    resolve_global_batch(cfg, world)
    return cfg


@pytest.mark.parametrize("extra, says", [
    (["data.resize=crop", "data.max_patches_choices=[4,16]"], "data.max_patches_choices draws the patch budget"),
    (["data.max_patches_choices=[4,32]"], "data.max_patches_choices [32] outside [data.min_patches"),
    (["data.min_patches=8", "data.upscale=false", "data.max_patches_choices=[4,16]"], "[4] outside"),
    (["data.batching=budget", "data.max_patches_choices=[4,16]"], "needs data.batching fixed"),
    (["train.accumulation=2", "data.max_patches_choices=[4,16]"], "a step span two epochs"),
])
def test_a_bad_config_is_refused_in_one_line(extra, says):
    with pytest.raises(ConfigError) as e:
        cfg = config(*extra)
        image_layout(cfg.data)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_layout_line_names_the_choices():
    cfg = config("data.max_patches_choices=[4,16]", "data.global_batch_size=8", "data.micro_batch_size=4",
                 "data.patch_size=16")
    assert cfg.train.accumulation == 2
    assert image_layout(cfg.data).describe().endswith("each step's budget drawn from [4, 16]")


def audited_budgets(run_dir: Path, accumulation: int) -> dict[tuple[int, int], set[int]]:
    """(epoch, optimizer step) -> the sequence lengths its batches had, over every rank and micro-batch."""
    out: dict = defaultdict(set)
    for f in (run_dir / "audit").glob("rank*.jsonl"):
        for r in map(json.loads, f.read_text().splitlines()):
            if r["kind"] == "batch":
                out[(r["epoch"], r["step"] // accumulation)].add(r["patches"])
    return dict(out)


def run(shapes: Path, run_dir: Path, nproc: int, **extra):
    settings = {"data__resize": "native", "data__max_patches": 16, "data__max_patches_choices": "[1,4,9,16]",
                "data__global_batch_size": 8, "data__audit": "true", "train__max_steps": 12, "train__log_every": 1}
    return train(shapes, run_dir, nproc=nproc, timeout=240, **{**settings, **extra})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_steps_budget_is_the_same_on_any_split_and_after_a_resume(tmp_path_factory, tmp_path):
    shapes = session_shapes(tmp_path_factory)
    two, one = tmp_path / "two", tmp_path / "one"
    ok(run(shapes, two, 2))
    ok(run(shapes, one, 1, data__micro_batch_size=4))
    seen = audited_budgets(two, 1)
    assert len(seen) == 12 and all(len(b) == 1 for b in seen.values())
    assert seen == audited_budgets(one, 2)
    assert len(set.union(*seen.values())) > 1  # the steps' budgets differ: the choice is not ignored
    assert len(losses(two)) == 12 and worst(losses(one), losses(two)) < 1e-5

    stopped = from_checkpoint(two, tmp_path / "stopped")
    assert_resumed_exactly(ok(run(shapes, stopped, 2)), stopped, 4)
    resumed = audited_budgets(stopped, 1)
    assert len(resumed) == 8 and resumed == {k: seen[k] for k in resumed}
    assert_identical(final_state(stopped), final_state(two))
