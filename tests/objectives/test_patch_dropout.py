"""Patch dropout (FLIP): which patches each image keeps, keyed by the sample and the step, and a
tower that runs on the kept ones as it would on those patches alone. The same on any split and
across a resume: ``tests/train/test_global_batch.py`` (fusion and unimodal cases)."""

from __future__ import annotations

import pytest
import torch
from kits.modelkit import make_batch, rows, small_model
from model.test_native_vision import GRIDS, patches, tower

from vltrain.config.job import load_config
from vltrain.errors import ConfigError
from vltrain.model.config import LossConfig, VisionSettings
from vltrain.model.vision import run_blocks
from vltrain.objectives.keyed import StepKey
from vltrain.objectives.scoring import Objectives
from vltrain.pixels import kept_patches
from vltrain.pixels import patchify
from vltrain.compose.rules import fit_native
from vltrain.images import Images, real_patches


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75, 0.9])
def test_each_image_keeps_its_share_of_its_real_patches(fraction):
    n = 16
    draw = torch.rand(len(GRIDS), n, generator=torch.Generator().manual_seed(0))
    real = real_patches(GRIDS, n)
    keep = kept_patches(draw, real, fraction)
    width = n - int(fraction * n)
    assert keep.shape == (len(GRIDS), width) and keep.dtype == torch.int64
    assert torch.equal(keep, keep.sort(dim=1).values) and all(len(set(k.tolist())) == width for k in keep)
    counts = real.sum(dim=1)
    assert torch.equal(real.gather(1, keep).sum(dim=1), counts - torch.floor(fraction * counts.double()).long())
    # the kept ones are those with the smallest draws among the image's real patches
    for i in range(len(GRIDS)):
        kept = [j for j in keep[i].tolist() if real[i, j]]
        dropped = [j for j in range(n) if real[i, j] and j not in kept]
        assert not dropped or max(draw[i, kept]) < min(draw[i, dropped])
    square = kept_patches(draw, None, fraction)
    assert square.shape == (len(GRIDS), width) and torch.equal(square, square.sort(dim=1).values)


def objectives(**vision) -> Objectives:
    return Objectives(LossConfig(), small_model().spec, VisionSettings(**vision))


def test_the_draw_follows_the_sample_and_the_step_and_stops_after_its_last_step():
    drop = objectives(patch_dropout=0.5, patch_dropout_until=3)
    batch = make_batch(6, ids=[10, 11, 12, 13, 14, 15])
    keyed = lambda b, step: drop.patch_keep(type(b)(**{**vars(b), "key": StepKey(7, step)}))  # noqa: E731
    keep = keyed(batch, 0)
    assert keep.shape == (6, small_model().spec.num_patches // 2)
    # a sample keeps the same patches in any row of any micro-batch
    order = torch.tensor([4, 1, 5, 0])
    assert torch.equal(keyed(rows(batch, order), 0), keep[order])
    assert not torch.equal(keyed(batch, 1), keep)  # another step, another draw
    assert not torch.equal(keyed(make_batch(6, ids=[20, 21, 22, 23, 24, 25]), 0), keep)  # other samples
    assert keyed(batch, 2) is not None and keyed(batch, 3) is None  # steps 1 to 3 drop (0-based 0 to 2)
    assert drop.patch_keep(batch) is None  # no key: evaluation sees every patch
    assert objectives().patch_keep(type(batch)(**{**vars(batch), "key": StepKey(7, 0)})) is None  # off
    # what the throughput meter counts: the blocks see K tokens while the dropout lasts
    n = small_model().spec.num_patches
    assert [drop.kept_patch_count(s) for s in range(4)] == [n // 2, n // 2, n // 2, None]
    assert objectives(patch_dropout=0.3).kept_patch_count(10**6) == n - int(0.3 * n)


def test_model_flops_count_the_patches_the_blocks_see():
    clip, albef = small_model("tiny-clip"), small_model("tiny-albef", itm=1.0, mlm=1.0)
    for model in (clip, albef):
        n = model.vision.cfg.num_patches
        assert model.flops_per_sample(8, n) == model.flops_per_sample(8)
        assert model.flops_per_sample(8, n // 4) < model.flops_per_sample(8, n // 2) < model.flops_per_sample(8)
    # the blocks' share scales with the tokens; the patch embedding is paid for every patch
    v = clip.vision
    embed = 2 * v.cfg.num_patches * 3 * v.cfg.patch_size**2 * v.cfg.width
    full, half = v.flops() - embed, v.flops(v.cfg.num_patches // 2) - embed
    assert 0.4 < half / full < 0.6


@pytest.mark.parametrize("pooling,class_token", [("map", False), ("mean", False), ("cls", True), ("map", True)])
def test_kept_patches_of_images_at_their_own_shape_encode_as_the_masked_batch(pooling, class_token):
    """Gathering the kept tokens is attention masked to them: the same tokens and pooled vector."""
    vit = tower(pooling, class_token)
    x, n = patches(GRIDS, length=20), 20
    keep = kept_patches(torch.rand(len(GRIDS), n, generator=torch.Generator().manual_seed(3)), real_patches(GRIDS, n),
                        0.5)
    with torch.no_grad():
        tokens, pooled = vit(Images(x, GRIDS, keep=keep))
        full, real = vit.embed_grids(x, GRIDS)
        p = vit.num_prefix
        masked = real.clone()
        masked[:, p:] = False
        masked[:, p:].scatter_(1, keep, real[:, p:].gather(1, keep))
        y = vit.norm(run_blocks(vit.blocks, vit.norm_pre(full) if vit.norm_pre else full, masked[:, None, None, :]))
        want = vit.patch_dropout(y, keep)
        assert torch.equal(tokens.real, vit.patch_dropout(masked, keep))
        torch.testing.assert_close(tokens.values[tokens.real], want[tokens.real], atol=1e-5, rtol=0)
        torch.testing.assert_close(pooled, vit.pool(y, masked), atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling,class_token", [("map", False), ("mean", False), ("cls", True)])
def test_square_images_keep_k_tokens_and_equal_the_same_patches_at_their_full_grid(pooling, class_token):
    vit = tower(pooling, class_token)
    grid = vit.cfg.image_size // vit.cfg.patch_size
    grids = torch.tensor([[grid, grid]] * 3)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    x = patchify(pixels, 8)
    keep = kept_patches(torch.rand(3, grid * grid, generator=torch.Generator().manual_seed(4)), None, 0.75)
    with torch.no_grad():
        tokens, pooled = vit(Images(pixels, keep=keep))
        by_grid, pooled_grid = vit(Images(x, grids, keep=keep))
        everything, _ = vit(Images(pixels, keep=torch.arange(grid * grid).expand(3, -1)))
        plain, _ = vit(pixels)
        plain_grid, _ = vit(Images(x, grids))
    torch.testing.assert_close(plain.values, plain_grid.values, atol=1e-5, rtol=0)  # what the comparison rests on
    assert tokens.real is None and tokens.values.shape == (3, vit.num_prefix + keep.shape[1], 32)
    torch.testing.assert_close(tokens.values, by_grid.values, atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled, pooled_grid, atol=1e-5, rtol=0)
    torch.testing.assert_close(everything.values, plain.values, atol=1e-6, rtol=0)  # keeping all is no dropout


def test_a_model_in_a_training_step_encodes_kept_patches_and_every_one_otherwise():
    model = small_model("tiny-albef", itm=1.0)
    drop = objectives(patch_dropout=0.5)
    batch = make_batch(4, has_image=[True, False, True, True])
    keyed = type(batch)(**{**vars(batch), "key": StepKey(0, 0)})
    keyed = type(batch)(**{**vars(keyed), "images": keyed.images.kept(drop.patch_keep(keyed))})
    kept, every = model.encode(keyed), model.encode(batch)
    n = model.spec.num_patches
    assert kept.image_tokens.values.shape[1] == 1 + n // 2 and every.image_tokens.values.shape[1] == 1 + n
    assert not torch.allclose(kept.image_embeds, every.image_embeds)
    assert torch.equal(kept.image_embeds[1], torch.zeros_like(kept.image_embeds[1]))  # the row without an image


def test_out_of_range_dropout_is_refused_naming_the_key():
    for value, key in ((1.0, "patch_dropout"), (-0.1, "patch_dropout"), (-1, "patch_dropout_until")):
        with pytest.raises(ConfigError, match=f"model.vision.{key} must be"):
            load_config(None, [f"model.vision.{key}={value}"])
    cfg = load_config(None, ["model.vision.patch_dropout=0.5", "data.resize=native", "data.pack_images=true"])
    fit_native(cfg)  # packed images take patch dropout
    assert cfg.data.pack_images and cfg.model.vision.patch_dropout == 0.5


@pytest.mark.parametrize("fraction", [0.5, 0.75])
@pytest.mark.parametrize("pooling,class_token", [("map", False), ("mean", False), ("cls", True), ("map", True)])
def test_packed_images_keep_their_kept_patches_in_shorter_sequences(pooling, class_token, fraction):
    """Packed, each sequence holds only its images' kept patches and is cut to them: the tokens and
    pooled vectors are those of the padded layout under the same draw."""
    from model.test_native_vision import packed

    from vltrain.pixels import drop_packed

    vit = tower(pooling, class_token)
    small = torch.tensor([[1, 2], [2, 3], [3, 1], [2, 2], [1, 1]])  # images that share sequences
    grids = torch.cat([GRIDS, small])
    x = torch.cat([patches(GRIDS), patches(small, seed=5)])
    pixels, layout = packed(x, grids)
    n = pixels.shape[1]
    keep = kept_patches(torch.rand(len(grids), n, generator=torch.Generator().manual_seed(3)), real_patches(grids, n),
                        fraction)
    shorter, segments, _ = drop_packed(pixels, real_patches(grids, n), layout["segments"], layout["patch_index"],
                                       keep, layout["slots"].shape[1])
    kept = int(real_patches(grids, n).sum() - torch.floor(fraction * grids.prod(-1).double()).sum())
    assert int((segments >= 0).sum()) == kept  # every kept patch, and no other
    assert shorter.shape[1] < n and shorter.shape[1] <= keep.shape[1] + layout["slots"].shape[1]
    with torch.no_grad():
        padded_tokens, padded = vit(Images(x, grids, keep=keep))
        tokens, together = vit(Images(pixels, grids, **layout, keep=keep))
    torch.testing.assert_close(together, padded, atol=1e-5, rtol=0)
    assert torch.equal(tokens.real, padded_tokens.real)
    torch.testing.assert_close(tokens.values[tokens.real], padded_tokens.values[tokens.real], atol=1e-5, rtol=0)
    with torch.no_grad():
        _, every = vit(Images(pixels, grids, **layout))
    assert not torch.allclose(every, together)  # the dropout took effect
